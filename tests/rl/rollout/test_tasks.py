"""megatron_r3.rl.rollout.tasks: seeded prompts, correct answers and partial-credit rewards."""

import numpy as np
import pytest

from megatron_r3.rl.rollout.tasks import BOS, EOS, FIRST_SYMBOL, SEP, SymbolTask


def test_prompts_depend_on_seed_iteration_and_index_only():
    task = SymbolTask("reverse", num_symbols=8, min_symbols=3, max_symbols=6)
    all_four = task.prompts(7, 3, range(4))
    last_two = task.prompts(7, 3, [2, 3])  # another data-parallel rank's share
    assert [p.token_ids.tolist() for p in all_four[2:]] == [p.token_ids.tolist() for p in last_two]
    assert [p.token_ids.tolist() for p in task.prompts(7, 4, range(4))] != [p.token_ids.tolist() for p in all_four]
    for p in all_four:
        assert p.token_ids[0] == BOS and p.token_ids[-1] == SEP
        symbols = p.token_ids[1:-1]
        assert 3 <= len(symbols) <= 6 and ((symbols >= FIRST_SYMBOL) & (symbols < FIRST_SYMBOL + 8)).all()


@pytest.mark.parametrize("name, transform", [("copy", lambda s: s), ("reverse", lambda s: s[::-1]),
                                             ("sort", sorted)])
def test_answers_transform_the_symbols_and_end_with_eos(name, transform):
    task = SymbolTask(name, num_symbols=5, min_symbols=2, max_symbols=9)
    for p in task.prompts(0, 1, range(20)):
        assert p.answer.tolist() == list(transform(p.token_ids[1:-1].tolist())) + [EOS]
        assert task.reward(p, p.answer) == 1.0


def test_rewards_give_partial_credit_per_answer_position():
    task = SymbolTask("reverse", num_symbols=8, min_symbols=3, max_symbols=3)
    p = task.prompts(0, 1, [0])[0]
    right = p.answer.tolist()  # three symbols, then EOS
    wrong = FIRST_SYMBOL + (np.asarray(right[:3]) - FIRST_SYMBOL + 1) % 8
    assert task.reward(p, [right[0], wrong[1], right[2], EOS]) == 0.75
    assert task.reward(p, right[:2]) == 0.5  # stopped early
    assert task.reward(p, right[:3] + [right[0], EOS]) == 0.75  # ran on past the answer
    assert task.reward(p, []) == 0.0


def test_bad_task_settings_are_refused():
    with pytest.raises(ValueError, match="unknown task 'rot13'"):
        SymbolTask("rot13")
    with pytest.raises(ValueError, match=r"1 <= min \(4\) <= max \(3\)"):
        SymbolTask("copy", min_symbols=4, max_symbols=3)
