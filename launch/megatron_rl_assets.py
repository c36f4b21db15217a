#!/usr/bin/env python3
"""What Megatron-LM's train_rl.py needs to run offline: a tokenizer, a countdown data set, an env config.

* ``tokenizer/``: a character-level HuggingFace tokenizer (every printable ASCII character and the
  newline, role and end-of-turn tokens, a chat template), built with ``tokenizers`` and saved with
  ``transformers``: what ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR`` loads
  without a download. A random-init model needs no real vocabulary; the chat completions endpoint
  of the RL loop needs a chat template.
* ``countdown/train.arrow``: countdown tasks (3 or 4 numbers in [1, 99] and a target reachable
  from them), generated here, as the Arrow stream Megatron-LM's own ``CountdownAgent`` reads with
  ``dataset_file`` (its ``get_dataset`` takes the first 327680 rows for training and the next 1024
  for validation).
* ``countdown.yaml``: the ``--langrl-env-config`` naming that agent and data set.

Usage: python launch/megatron_rl_assets.py OUT [--overwrite]
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

import numpy as np

COUNTDOWN_ROWS = 327680 + 1024 + 1  # CountdownAgent asserts more rows than train + test
# Not the pad at id 0: train_rl.py looks for a pad token with `if not tokenizer.pad` (rl_utils.py,
# prepare_trajectories), which reads a pad id of 0 as none ("No pad token found in tokenizer vocabulary").
SPECIAL = ["<|unk|>", "<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(out):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {token: i for i, token in enumerate(SPECIAL + chars)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<|pad|>", unk_token="<|unk|>", eos_token="<|end|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return len(vocab)


def countdown_rows(count, seed=0):
    """``count`` countdown tasks and a solution of each: 3 or 4 numbers in [1, 99] and the value in
    (0, 1000) of a random left-to-right expression of them ((a op b) op c ..., op in +, -, *).

    The data set gets ``target`` and ``nums`` only (CountdownAgent builds its prompt from exactly
    those); the solutions are for tests of the rewards."""
    rng = np.random.default_rng(seed)
    rows = {"target": [], "nums": []}
    solutions = []
    while len(solutions) < count:
        batch = 2 * (count - len(solutions))
        sizes = rng.integers(3, 5, batch)
        nums = rng.integers(1, 100, (batch, 4))
        ops = rng.integers(0, 3, (batch, 3))
        value = nums[:, 0].copy()
        for i in range(1, 4):
            step = np.choose(ops[:, i - 1], [value + nums[:, i], value - nums[:, i], value * nums[:, i]])
            value = np.where(i < sizes, step, value)
        for k in np.flatnonzero((value > 0) & (value < 1000))[: count - len(solutions)]:
            used = nums[k, : sizes[k]].tolist()
            expression = str(used[0])
            for op, n in zip(ops[k], used[1:]):
                expression = f"({expression} {'+-*'[op]} {n})"
            rows["target"].append(int(value[k]))
            rows["nums"].append(used)
            solutions.append(expression)
    return rows, solutions


def build_countdown(out):
    """``out/train.arrow``: the tasks as one Arrow stream, the only file in the folder (the agent's
    ``load_dataset("arrow", data_dir=...)`` reads every file there: ``save_to_disk``'s JSON
    sidecars would fail it)."""
    import pyarrow as pa

    rows, _ = countdown_rows(COUNTDOWN_ROWS)
    table = pa.table({"target": pa.array(rows["target"], pa.int64()),
                      "nums": pa.array(rows["nums"], pa.list_(pa.int64()))})
    os.makedirs(out)
    with pa.OSFile(os.path.join(out, "train.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def env_config(countdown_dir):
    # YAML is a superset of JSON: the config needs no YAML writer.
    return json.dumps([{
        "agent_type": "CountdownAgent",
        "agent_args": {"dataset_file": countdown_dir, "split": "train"},
        "weight": 1.0,
    }], indent=2) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="folder to create")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT where it exists")
    args = parser.parse_args(argv)
    out = os.path.abspath(args.out)
    if os.path.exists(out) and not args.overwrite:
        print(f"megatron_rl_assets: error: {out} exists (--overwrite replaces it)", file=sys.stderr)
        return 1
    os.makedirs(os.path.dirname(out), exist_ok=True)
    work = tempfile.mkdtemp(prefix=".megatron-rl-assets.", dir=os.path.dirname(out))
    try:
        vocab = build_tokenizer(os.path.join(work, "tokenizer"))
        print(f"tokenizer: {vocab} tokens", flush=True)
        build_countdown(os.path.join(work, "countdown"))
        print(f"countdown: {COUNTDOWN_ROWS} tasks", flush=True)
        with open(os.path.join(work, "countdown.yaml"), "w") as f:
            f.write(env_config(os.path.join(out, "countdown")))
        if os.path.exists(out):
            shutil.rmtree(out)
        os.rename(work, out)
    finally:
        if os.path.exists(work):
            shutil.rmtree(work)
    print(f"assets ready at {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
