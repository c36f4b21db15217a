#!/usr/bin/env python3
"""Countdown solved, as text: the corpus the train_rl example's model learns before RL.

RL starts from a trained model. A random-init MoE has experts that barely differ, so a token
routed to another expert changes little, and the train/inference mismatch routing replay removes
is a small part of the whole (docs/megatron_rl.md). ``launch/countdown_sft_r3.sh`` trains the
example's model on this corpus with Megatron-LM's ``pretrain_gpt.py`` first.

Each document is one chat as the RL loop renders it, answered: the user turn is
``CountdownAgent.make_prefix`` of a task (the agent loaded from the example's env config, as
``train_rl.py`` loads it), the assistant turn ``<answer> EXPR </answer>`` with a solution that
uses each number once and reaches the target, then the end-of-turn token (the tokenizer's EOD).
The tasks are drawn with another seed than the RL data set's. Written with Megatron's
``IndexedDatasetBuilder`` as ``PREFIX.bin`` and ``PREFIX.idx`` (``--data-path PREFIX``).

Usage (in a Megatron-LM checkout, its ``megatron`` first on the path):
    python launch/countdown_sft_data.py ASSETS PREFIX [--documents N] [--overwrite]
ASSETS: the folder launch/megatron_rl_assets.py made (tokenizer/, countdown.yaml).
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_rl_assets  # noqa: E402

SFT_SEED = 1  # megatron_rl_assets.build_countdown draws the RL tasks with seed 0


def chats(prefix, rows, solutions) -> list:
    """The answered chat of each task: ``prefix(target, nums)`` then ``<answer> solution </answer>``."""
    return [
        [{"role": "user", "content": prefix(target, nums)},
         {"role": "assistant", "content": f"<answer> {solution} </answer>"}]
        for target, nums, solution in zip(rows["target"], rows["nums"], solutions)
    ]


def write_corpus(tokenizer, prefix, documents: int, path_prefix: str) -> int:
    """Write ``documents`` answered chats at ``path_prefix`` (.bin, .idx); returns the token count."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path

    rows, solutions = megatron_rl_assets.countdown_rows(documents, seed=SFT_SEED)
    texts = [tokenizer.apply_chat_template(chat, tokenize=False) for chat in chats(prefix, rows, solutions)]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    # Written under another prefix and renamed into place, the index last: a run stopped while writing
    # leaves no index that names a partial data file.
    partial = f"{path_prefix}.partial-{os.getpid()}"
    builder = IndexedDatasetBuilder(get_bin_path(partial), dtype=DType.optimal_dtype(len(tokenizer)))
    for doc in ids:
        builder.add_document(np.asarray(doc), [len(doc)])
    builder.finalize(get_idx_path(partial))
    os.replace(get_bin_path(partial), get_bin_path(path_prefix))
    os.replace(get_idx_path(partial), get_idx_path(path_prefix))
    return sum(len(doc) for doc in ids)


def countdown_prefix(env_config: str):
    """``make_prefix`` of the countdown agent the env config names, loaded as train_rl.py loads it."""
    import yaml
    from megatron.rl.agent.weighted_multi_task import WeightedMultiTask

    with open(env_config) as f:
        agent = WeightedMultiTask.from_config(yaml.safe_load(f)).agents[0]
    return agent.make_prefix


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("assets", help="the folder launch/megatron_rl_assets.py made")
    parser.add_argument("prefix", help="the data set's path prefix (PREFIX.bin, PREFIX.idx)")
    parser.add_argument("--documents", type=int, default=20000, help="answered tasks (default 20000)")
    parser.add_argument("--overwrite", action="store_true", help="replace PREFIX.bin and PREFIX.idx where they exist")
    args = parser.parse_args(argv)
    if args.documents < 1:
        parser.error(f"--documents {args.documents}: give at least 1")
    existing = [p for p in (f"{args.prefix}.bin", f"{args.prefix}.idx") if os.path.exists(p)]
    if existing and not args.overwrite:
        print(f"countdown_sft_data: error: {existing[0]} exists (--overwrite replaces it)", file=sys.stderr)
        return 1
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(args.assets, "tokenizer"))
    os.makedirs(os.path.dirname(os.path.abspath(args.prefix)), exist_ok=True)
    prefix = countdown_prefix(os.path.join(args.assets, "countdown.yaml"))
    tokens = write_corpus(tokenizer, prefix, args.documents, args.prefix)
    print(f"countdown SFT corpus: {args.documents} documents, {tokens} tokens at {args.prefix}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
