"""The example's supervised warm start: the countdown corpus (launch/countdown_sft_data.py) and the
launch script's refusals (launch/countdown_sft_r3.sh). The corpus is read back with Megatron's own
``IndexedDataset``, as pretrain_gpt.py reads it; the test against Megatron-LM's ``CountdownAgent``
(its prompt and its reward of every answer) needs a checkout (MEGATRON_GIT) and skips without one."""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.megatron_lm.test_train_rl_example import ROOT, assets, checkout, run_in_checkout  # noqa: F401

sys.path.insert(0, str(ROOT / "launch"))
import countdown_sft_data  # noqa: E402
import megatron_rl_assets  # noqa: E402

SCRIPT = ROOT / "launch" / "countdown_sft_r3.sh"


def prompt_like_the_agent(target, nums):
    return f"Using the numbers {nums}, create an equation that equals {target}.\n Answer in <answer> </answer> tags."


def test_each_answered_chat_is_one_document_that_continues_the_rl_loop_s_prompt(assets, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(assets / "tokenizer"))
    prefix = str(tmp_path / "sft" / "countdown")
    os.makedirs(tmp_path / "sft")
    tokens = countdown_sft_data.write_corpus(tokenizer, prompt_like_the_agent, 37, prefix)
    data = IndexedDataset(prefix)
    rows, solutions = megatron_rl_assets.countdown_rows(37, seed=countdown_sft_data.SFT_SEED)
    rl_rows, _ = megatron_rl_assets.countdown_rows(37)
    assert rows != rl_rows  # not the RL loop's tasks
    assert len(data) == 37 and data.sequence_lengths.sum() == tokens
    assert data.index.dtype == np.uint16  # a 102-token vocabulary (Megatron's optimal_dtype)
    for i, (target, nums, solution) in enumerate(zip(rows["target"], rows["nums"], solutions)):
        doc = data[i].tolist()
        # What the engine is asked to continue (one user turn, the generation prompt), then the answer.
        asked = tokenizer.apply_chat_template([{"role": "user", "content": prompt_like_the_agent(target, nums)}],
                                              add_generation_prompt=True, tokenize=False)
        asked_ids = tokenizer(asked, add_special_tokens=False)["input_ids"]
        assert doc[:len(asked_ids)] == asked_ids
        assert tokenizer.decode(doc[len(asked_ids):]) == f"<answer> {solution} </answer><|end|>"
        assert doc[-1] == tokenizer.eos_token_id  # Megatron's EOD for a HuggingFace tokenizer
        assert eval(solution) == target  # noqa: S307 (our own expressions)
    assert sorted(os.listdir(tmp_path / "sft")) == ["countdown.bin", "countdown.idx"]  # nothing partial left


def test_the_corpus_script_refuses_to_replace_a_corpus_without_overwrite(tmp_path, capsys):
    (tmp_path / "countdown.idx").write_text("")
    assert countdown_sft_data.main([str(tmp_path / "assets"), str(tmp_path / "countdown")]) == 1
    assert f"{tmp_path / 'countdown.idx'} exists (--overwrite replaces it)" in capsys.readouterr().err


def test_the_corpus_takes_megatron_lm_s_countdown_prompt_and_each_answer_earns_the_full_reward(checkout, assets,
                                                                                              tmp_path):
    """The prompts come from CountdownAgent as train_rl.py loads it (``countdown_prefix``, in the checkout);
    the corpus is written and read back here (the checkout's megatron.core needs triton, which this
    host lacks; the file format is the same)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import AutoTokenizer

    rows, solutions = megatron_rl_assets.countdown_rows(50, seed=countdown_sft_data.SFT_SEED)
    tasks = [{"target": t, "nums": n} for t, n in zip(rows["target"], rows["nums"])]
    out = run_in_checkout(checkout, f"""
        import asyncio, json, sys
        sys.path.insert(0, {str(ROOT / "launch")!r})
        import countdown_sft_data
        from megatron.rl.agent.weighted_multi_task import WeightedMultiTask
        import yaml
        prefix = countdown_sft_data.countdown_prefix({str(assets / "countdown.yaml")!r})
        agent = WeightedMultiTask.from_config(yaml.safe_load(open({str(assets / "countdown.yaml")!r}))).agents[0]
        tasks, solutions = {tasks!r}, {solutions!r}
        print(json.dumps({{"prompts": [prefix(**t) for t in tasks], "agent": type(agent).__name__,
                          "rewards": [asyncio.run(agent.get_reward(f"<answer> {{s}} </answer>", t, "stop"))
                                      for t, s in zip(tasks, solutions)]}}))
    """, tmp_path)
    assert out["agent"] == "CountdownAgent" and out["rewards"] == [1.0] * 50
    prompts = {(t["target"], tuple(t["nums"])): p for t, p in zip(tasks, out["prompts"])}
    tokenizer = AutoTokenizer.from_pretrained(str(assets / "tokenizer"))
    prefix = str(tmp_path / "countdown")
    countdown_sft_data.write_corpus(tokenizer, lambda target, nums: prompts[(target, tuple(nums))], 50, prefix)
    data = IndexedDataset(prefix)
    for i, (prompt, solution) in enumerate(zip(out["prompts"], solutions)):
        assert "Using the numbers" in prompt and "<answer>" in prompt
        assert tokenizer.decode(data[i].tolist()) == \
            f"<|user|>{prompt}<|end|><|assistant|><answer> {solution} </answer><|end|>"


def test_the_sft_script_refuses_what_cannot_run_naming_it(tmp_path):
    tree = tmp_path / "Megatron-LM"
    (tree / "megatron" / "rl").mkdir(parents=True)
    (tree / "train_rl.py").write_text("")
    (tree / "megatron" / "rl" / "routing_replay.py").write_text("")
    python = tmp_path / "python3.12"  # passes the version check
    python.write_text("#!/bin/sh\nexit 0\n")
    python.chmod(0o755)

    def launch(**env):
        return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")],
                              env={**os.environ, "PYTHON": str(python), **env}, capture_output=True, text=True,
                              timeout=60)

    proc = launch(MEGATRON=str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and "countdown_sft_r3.sh: MEGATRON=" in proc.stderr and "is not a folder" in proc.stderr
    for bad in ("0", "abc", "-5"):
        proc = launch(MEGATRON=str(tree), SFT_ITERS=bad)
        assert proc.returncode == 2 and f"SFT_ITERS={bad}: give a positive number" in proc.stderr
        proc = launch(MEGATRON=str(tree), SFT_DOCUMENTS=bad)
        assert proc.returncode == 2 and f"SFT_DOCUMENTS={bad}: give a positive number" in proc.stderr
    for bad in ("3", "0", "x"):  # 64 sequences an iteration, one microbatch per GPU
        proc = launch(MEGATRON=str(tree), NPROC=bad)
        assert proc.returncode == 2 and f"NPROC={bad}: give a number of GPUs that divides 64" in proc.stderr
    proc = launch(MEGATRON=str(tree), EXTRA_ARGS="--attention-backend flash")
    assert proc.returncode == 2 and "EXTRA_ARGS --attention-backend flash" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing made before the refusals
