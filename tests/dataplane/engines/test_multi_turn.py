"""Multi-turn rollouts: turns that re-encode the earlier ones become one sample; retracted requests are refused.

A rollout of three turns (SkyRL 0.4's accumulation: each turn's prompt is the previous turn's
tokens plus an observation), each turn a vLLM 0.33 request whose routes cover every token it
ran. Later turns re-route some re-encoded tokens differently (and report others in another
top-k order, which routes the same experts). The merged sample must keep, for every token, the
route and log-prob of the turn that first ran it, and count the re-routed tokens.
"""

import json
import re

import numpy as np
import pytest

from megatron_r3.dataplane.engines.engine_samples import check_retractions, sglang_sample, vllm_samples
from megatron_r3.dataplane.engines.multi_turn import merge_turns
from megatron_r3.dataplane.formats.dump_reader import RolloutDumpReader
from megatron_r3.dataplane.route_checks import RoutingValidationError
from tests.dataplane.engines.test_engine_formats import replay_input
from tests.dataplane.engines.test_engine_formats_2026_11 import npy_base64
from tests.dataplane.test_dump_rollouts import (
    MODEL_FLAGS, SPEC, CompletionOutput, RequestOutput, make_truth, sglang_response, vllm_positions,
)
from tools.dump_rollouts import main, request_output_to_json

# Token counts of the conversation: prompt, completion 0, observation 1, completion 1, observation 2, completion 2.
SEGMENTS = (5, 4, 3, 4, 2, 3)


class Conversation:
    """The truth of a three-turn rollout and what each turn's engine call returned."""

    def __init__(self, seed=0):
        rng = np.random.default_rng(seed)
        self.length = sum(SEGMENTS)
        self.tokens = [int(t) for t in rng.integers(0, 1000, self.length)]
        self.logprobs = -rng.random(self.length).astype(np.float32)
        self.logprobs[0] = 0.0
        # The route of each token in the pass that first ran it.
        truth = make_truth(rng, self.length - 1, 1)
        self.routes = truth.routes  # [length - 1, MoE layers, topk]
        bounds = np.cumsum(SEGMENTS)
        self.turn_ends = [int(bounds[1]), int(bounds[3]), int(bounds[5])]  # tokens of each turn
        self.prompt_ends = [int(bounds[0]), int(bounds[2]), int(bounds[4])]
        self.rerouted = {1: [1, 6], 2: [2, 6, 11]}  # turn -> re-encoded tokens that turn routes elsewhere
        self.reordered = {2: [3]}  # turn -> tokens routed to the same experts in another order

    def turn_rows(self, k):
        """What turn k's pass routed: [turn_end - 1, MoE layers, topk]."""
        rows = self.routes[:self.turn_ends[k] - 1].copy()
        for token in self.rerouted.get(k, []):
            rows[token] = (rows[token] + 1) % SPEC.num_experts  # other experts, still distinct
        for token in self.reordered.get(k, []):
            rows[token] = rows[token][:, ::-1]
        return rows

    def turn_request(self, k, prompt_start=0):
        """Turn k as vLLM 0.33 returns it: prompt = everything before its completion."""
        end, prompt_end = self.turn_ends[k], self.prompt_ends[k]
        full = np.zeros((end - 1, SPEC.num_layers, SPEC.topk), np.uint8)
        full[:, np.asarray(SPEC.model_moe_layers) - 1] = self.turn_rows(k)
        # A later turn recomputes the earlier log-probs of its prompt; they differ from the sampling pass's.
        prompt_logprobs = self.logprobs[:prompt_end] - (0.25 * k)
        completion = CompletionOutput(
            index=0, text="", token_ids=self.tokens[prompt_end:end], cumulative_logprob=None,
            logprobs=vllm_positions(self.tokens[prompt_end:end], self.logprobs[prompt_end:end]),
            routed_experts=full[prompt_start:], finish_reason="stop")
        return RequestOutput(f"conv-turn{k}", None, self.tokens[:prompt_end],
                             [None] + vllm_positions(self.tokens[1:prompt_end], prompt_logprobs[1:]), [completion])

    def turn_samples(self, prompt_starts=(0, 0, 0)):
        return [vllm_samples(self.turn_request(k, start), SPEC, prompt_start=start)[0]
                for k, start in enumerate(prompt_starts)]


def test_three_turns_give_one_sample_with_the_first_pass_of_every_token():
    conversation = Conversation()
    merged = merge_turns(conversation.turn_samples(), "request 'conv'")
    sample = merged.sample
    assert sample.token_ids.tolist() == conversation.tokens
    completion = np.zeros(conversation.length, bool)
    for prompt_end, end in zip(conversation.prompt_ends, conversation.turn_ends):
        completion[prompt_end:end] = True
    assert sample.loss_mask.tolist() == completion.tolist()
    # Every completion token's log-prob is its sampling pass's; prompt tokens keep the first turn that held them.
    expected = conversation.logprobs.copy()
    expected[conversation.turn_ends[0]:conversation.prompt_ends[1]] -= 0.25  # observation 1: first held by turn 1
    expected[conversation.turn_ends[1]:conversation.prompt_ends[2]] -= 0.5  # observation 2: turn 2
    np.testing.assert_allclose(sample.logprobs, expected)
    # Routes: the first pass's everywhere, the final sampled token of turns 0 and 1 from the next turn
    # (first run there), none for the rollout's last token.
    assert sample.routes.valid.tolist() == [True] * (conversation.length - 1) + [False]
    np.testing.assert_array_equal(sample.routes.to_int64()[:-1], conversation.routes)
    # Tokens 1 and 6 differ in turn 1, tokens 2, 6 and 11 in turn 2; token 3 only in order: 4 tokens.
    assert merged.rerouted_tokens == 4 and merged.first_rerouted == (1, 1)
    assert sample.meta["turns"] == 3 and sample.meta["rerouted_tokens"] == 4
    replayed = replay_input([sample])
    np.testing.assert_array_equal(replayed.permute(1, 0, 2).numpy()[:-1], conversation.routes)


def test_later_turns_that_skip_earlier_rows_are_merged_and_not_compared():
    """Turns 1 and 2 ask for rows from their own prompt start only (routed_experts_prompt_start), as an agent
    loop that accumulates routes does: nothing is compared, nothing is re-routed, every token keeps a route."""
    conversation = Conversation(seed=1)
    starts = (0, conversation.turn_ends[0] - 1, conversation.turn_ends[1] - 1)  # from each previous final token on
    merged = merge_turns(conversation.turn_samples(starts))
    assert merged.rerouted_tokens == 0 and merged.first_rerouted is None
    assert merged.sample.routes.valid.tolist() == [True] * (conversation.length - 1) + [False]
    np.testing.assert_array_equal(merged.sample.routes.to_int64()[:-1], conversation.routes)


def test_a_turn_that_does_not_re_encode_the_previous_one_is_refused():
    conversation = Conversation(seed=2)
    turns = conversation.turn_samples()
    turns[2].token_ids[7] += 1  # a re-tokenised history: token 7 differs
    with pytest.raises(RoutingValidationError, match=rf"request 'conv': turn 2 does not re-encode turn 1: its token 7 "
                                                     rf"is {conversation.tokens[7] + 1}, turn 1 has "
                                                     rf"{conversation.tokens[7]} there"):
        merge_turns(turns, "request 'conv'")
    with pytest.raises(RoutingValidationError, match="turn 1 does not re-encode turn 0: its token 9 is nothing"):
        merge_turns([turns[1], turns[0]])


def test_the_dump_tool_merges_a_turns_line_and_reports_the_re_routed_tokens(tmp_path, capsys):
    conversation = Conversation(seed=3)
    turns = []
    for k in range(3):
        line = request_output_to_json(conversation.turn_request(k))
        line["outputs"][0]["routed_experts"] = npy_base64(conversation.turn_request(k).outputs[0].routed_experts)
        turns.append(line)
    source, out = tmp_path / "turns.jsonl", tmp_path / "turns.r3dump"
    source.write_text(json.dumps({"turns": turns, "reward": 0.5}) + "\n")
    assert main(["--engine", "vllm", "--input", str(source), "--out", str(out), *MODEL_FLAGS]) == 0
    assert capsys.readouterr().out == (f"wrote {out}: 1 samples from 1 requests, 21 tokens, routed fraction 0.9524, "
                                       f"4 tokens re-routed by a later turn\n")
    with RolloutDumpReader(out) as reader:
        (sample,) = list(reader)
    assert sample.token_ids.tolist() == conversation.tokens
    np.testing.assert_array_equal(sample.routes.to_int64()[:-1], conversation.routes)
    assert sample.meta["reward"] == 0.5 and sample.meta["rerouted_tokens"] == 4 and sample.meta["turns"] == 3


def test_the_dump_tool_names_the_turn_that_does_not_fit(tmp_path, capsys):
    conversation = Conversation(seed=4)
    turns = [request_output_to_json(conversation.turn_request(k)) for k in range(3)]
    turns[1]["prompt_token_ids"][2] += 1000  # the runner-up of its prompt log-probs: the line itself reads
    source, out = tmp_path / "turns.jsonl", tmp_path / "turns.r3dump"
    source.write_text(json.dumps({"turns": turns}) + "\n")
    assert main(["--engine", "vllm", "--input", str(source), "--out", str(out), *MODEL_FLAGS]) == 1
    err = capsys.readouterr().err
    assert re.search(rf"line 1: request 'conv-turn0' \(3 turns\): turn 1 does not re-encode turn 0: its token 2", err)
    assert err.count("\n") == 1 and not out.exists()


# ---- retracted and recomputed requests ----

def test_a_request_retracted_after_sampling_is_refused_by_name():
    """miles #3277: after a retraction the engine returns the recomputing pass's routes beside the log-probs of
    the sampling pass; nothing in the response says so, so the caller's retraction record decides."""
    truth = make_truth(np.random.default_rng(5), 6, 5)
    response = sglang_response(truth)
    with pytest.raises(RoutingValidationError,
                       match=r"request 's3' sample 0: retracted and recomputed after 3 generated tokens "
                             r"\(retracted_at \[9\]\): the engine returns the recomputing pass's routes for tokens "
                             r"0\.\.8, but the log-probs of tokens 6\.\.8 are the sampling pass's \(miles #3277\); "
                             r"refused"):
        sglang_sample(response, truth.prompt, SPEC, retracted_at=[9])
    # A retraction before the first generated token: every log-prob and route comes from the recomputing pass.
    (sample,) = [sglang_sample(response, truth.prompt, SPEC, retracted_at=[4, 6])]
    np.testing.assert_array_equal(sample.routes.to_int64()[:-1], truth.routes)


@pytest.mark.parametrize("value, message", [
    ([0], r"retracted_at entry 0 is not a sample length in \[1, 11\]"),
    ([12], r"retracted_at entry 12 is not a sample length in \[1, 11\]"),
    ([True], r"retracted_at entry True is not a sample length"),
])
def test_retraction_lengths_are_checked(value, message):
    with pytest.raises(RoutingValidationError, match=rf"request 'q' sample 0: {message}"):
        check_retractions(value, 6, 11, "request 'q' sample 0")


def test_the_dump_tool_refuses_a_retracted_line(tmp_path, capsys):
    truth = make_truth(np.random.default_rng(6), 6, 5)
    source, out = tmp_path / "in.jsonl", tmp_path / "o.r3dump"
    source.write_text(json.dumps({"input_ids": truth.prompt, "response": sglang_response(truth),
                                  "retracted_at": [7]}) + "\n")
    assert main(["--engine", "sglang", "--input", str(source), "--out", str(out), *MODEL_FLAGS]) == 1
    err = capsys.readouterr().err
    assert f"{source} line 1: request 's3' sample 0: retracted and recomputed after 1 generated tokens" in err
    assert not out.exists()
