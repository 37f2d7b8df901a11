"""serve-bench's evidence that can fail: realistic weights (``weights``), teacher-forced agreement (``forced``,
``agreement``) and TPOT two ways (``tpot``), on the CPU with a tiny Llama-shaped model (tests/serve_bench_tiny.py)."""

from __future__ import annotations

import copy
import math
import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from serve_bench_tiny import TinyLlama, TinyRMSNorm, forced_record, greedy  # noqa: E402

from tunekit.evidence.serve_bench import agreement, forced, tpot, weights  # noqa: E402
from tunekit.evidence.verdict import Caps  # noqa: E402

PROMPTS = [[(7 * r + 13 * j) % 500 + 3 for j in range(8)] for r in range(4)]
TOL = 2.0 ** -6


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    model = TinyLlama()
    weights.realistic_init_(model, seed=0)
    return model


def test_realistic_weights_give_peaked_logits_and_greedy_tokens_that_move(tiny) -> None:
    vocab = tiny.lm_head.weight.shape[0]
    moved = 0
    for prompt in PROMPTS:
        tokens = greedy(tiny, prompt, 16)
        with torch.no_grad():
            lp = torch.log_softmax(tiny(torch.tensor([prompt + tokens]))[0, len(prompt) - 1:], dim=-1)
        entropy = -(lp.exp() * lp).sum(-1)
        assert float(entropy.mean()) < 0.4 * math.log(vocab)  # uniform: ln V; dummy weights sit near it
        assert float(lp.max(-1).values.exp().mean()) > 0.3  # the top token holds a real share
        moved += len(set(tokens)) > 1
    assert moved == len(PROMPTS)


def test_dummy_like_weights_are_what_the_recipe_replaces() -> None:
    """The contrast: vLLM's dummy loader's small uniform weights give a near-uniform next-token distribution."""
    model = TinyLlama()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-1e-3, 1e-3, generator=torch.Generator().manual_seed(0))
        lp = torch.log_softmax(model(torch.tensor([PROMPTS[0]]))[0], dim=-1)
    assert float(-(lp.exp() * lp).sum(-1).mean()) > 0.99 * math.log(512)


def test_the_recipe_is_seeded_per_name_and_writes_a_tied_head_once() -> None:
    a, b, c = TinyLlama(tied=True), TinyLlama(tied=True), TinyLlama(tied=True)
    counts = weights.realistic_init_(a, seed=3)
    weights.realistic_init_(b, seed=3)
    weights.realistic_init_(c, seed=4)
    assert counts == {"embedding": 1, "linear": 10, "output_linear": 4, "norm": 4, "final_norm": 1}
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pc), name
    assert a.lm_head.weight is a.model.embed_tokens.weight
    # scales per kind: N(0, 0.02) into the stream's readers, N(0, 0.02 / sqrt(2 L)) for what writes into it
    q = a.model.layers[0].self_attn.q_proj.weight.detach()
    o = a.model.layers[0].self_attn.o_proj.weight.detach()
    assert abs(float(q.std()) - 0.02) < 0.003 and abs(float(o.std()) - 0.01) < 0.002
    gains = a.model.layers[0].input_layernorm.weight.detach()
    assert float(gains.max()) >= 10.0 and float(gains.min()) <= 0.05 and 0.7 < float(gains.median()) < 1.4


def test_zero_centred_and_gated_norms() -> None:
    class GemmaRMSNorm(TinyRMSNorm):
        pass

    class Served(GemmaRMSNorm):  # a plugin's subclass keeps the convention of its base
        pass

    class Qwen3_5RMSNormGated(TinyRMSNorm):
        pass

    model = TinyLlama()
    model.model.layers[0].input_layernorm = Served(64)
    model.model.layers[1].input_layernorm = Qwen3_5RMSNormGated(64)
    weights.realistic_init_(model, seed=0)
    zero_centred = model.model.layers[0].input_layernorm.weight.detach()
    plain = model.model.layers[1].input_layernorm.weight.detach()
    assert abs(float(zero_centred.median())) < 0.4  # gain 1 + w: w near 0
    assert 0.7 < float(plain.median()) < 1.4


def _result(arm: str, index: int, rows: dict[int, dict]) -> dict:
    return {"arm": arm, "index": index, "batches": [{"batch": b, "forced": rec} for b, rec in rows.items()]}


def test_agreement_passes_a_correct_arm_and_fails_a_perturbed_one(tiny) -> None:
    """Same weights computed in another order pass all three checks; one norm gain 1% off, or one layer's weights
    rounded to BF16, fail: by the logprobs and the KL even where every greedy token still agrees."""
    steps, topk = 16, 20
    forced_tokens = [greedy(tiny, p, steps) for p in PROMPTS]
    vanilla = forced_record(tiny, PROMPTS, forced_tokens, topk)
    correct = forced_record(tiny, PROMPTS, forced_tokens, topk, merged=True)
    off = copy.deepcopy(tiny)
    rounded = copy.deepcopy(tiny)
    with torch.no_grad():
        off.model.layers[1].input_layernorm.weight.mul_(1.01)
        for p in rounded.model.layers[0].parameters():
            p.copy_(p.to(torch.bfloat16).float())
    arms = {"vanilla": [_result("vanilla", i, {4: vanilla}) for i in range(2)],
            "tuned": [_result("tuned", 0, {4: correct})],
            "folded": [_result("folded", 0, {4: forced_record(off, PROMPTS, forced_tokens, topk)})],
            "passthrough": [_result("passthrough", 0, {4: forced_record(rounded, PROMPTS, forced_tokens, topk)})]}
    caps = Caps(logprob=TOL, kl=TOL * TOL / 2)  # the tiny model's scale (the real checkpoints': test_real_verdict.py)
    doc = agreement.forced_agreement(arms, 4, caps)
    assert doc["caps"] == {"logprob": TOL, "kl": TOL * TOL / 2, "hard_share": 0.0}
    assert doc["spread_within_caps"] is True  # two vanilla processes, bit for bit
    tuned = doc["tuned"]
    assert tuned["verdict"] == "pass" and tuned["equal_share"] == 1.0 and tuned["positions"] == 4 * steps
    assert tuned["max_abs_logprob_diff"] < 1e-3 and tuned["kl_max"] < 1e-8
    for arm in ("folded", "passthrough"):
        bad = doc[arm]
        assert bad["verdict"] == "fail" and not bad["ok"], arm
        assert not bad["checks"]["logprob"] and not bad["checks"]["kl"], arm
        assert bad["max_abs_logprob_diff"] > 4 * TOL and bad["kl_max"] > TOL * TOL, arm
    assert agreement.verdict(doc, ("tuned",)) == "pass"
    assert agreement.verdict(doc, ("tuned", "folded")) == "fail"
    assert "FAIL" in agreement.line("folded", doc["folded"], doc) and "FAIL" not in agreement.line("tuned", tuned, doc)


def test_a_flipped_token_is_hard_unless_a_near_tie_and_a_spread_past_the_caps_is_inconclusive() -> None:
    def rec(tops: list[list[list]]) -> dict:
        return {"forced": [1, 1], "top": tops}

    ref = rec([[[1, -0.1], [2, -2.5]], [[1, -0.69], [2, -0.70]]])
    tie = rec([[[1, -0.1], [2, -2.5]], [[2, -0.692], [1, -0.697]]])  # step 1 flips within 0.005 nats
    hard = rec([[[2, -0.1], [1, -2.5]], [[1, -0.69], [2, -0.70]]])  # step 0 flips by 2.4 nats
    s_tie = agreement.summarize([agreement.compare_requests(ref, tie)], 0.1)
    s_hard = agreement.summarize([agreement.compare_requests(ref, hard)], 0.1)
    assert (s_tie["first_divergence"], s_tie["mismatches"], s_tie["hard_mismatches"]) == (1, 1, 0)
    assert (s_hard["first_divergence"], s_hard["hard_mismatches"], s_hard["equal_share"]) == (0, 1, 0.5)
    assert agreement.compare_requests(ref, {"forced": [1, 2], "top": ref["top"]}) is None  # other contexts
    # vanilla at batch 1 against batch 2: 0.02 nats apart, within a 0.05 cap: the caps judge
    wobble = rec([[[1, -0.12], [2, -2.5]], [[1, -0.69], [2, -0.70]]])
    arms = {"vanilla": [_result("vanilla", 0, {1: {"requests": [ref]}, 2: {"requests": [wobble]}})],
            "tuned": [_result("tuned", 0, {1: {"requests": [tie]}, 2: {"requests": [tie]}})]}
    caps = Caps(logprob=0.05, kl=0.05)  # a two-token toy: its bucketed KL is not a real model's
    doc = agreement.forced_agreement(arms, 1, caps)
    assert doc["spread"]["processes"] is None and doc["spread_within_caps"] is True
    assert doc["spread"]["batches"]["max_abs_logprob_diff"] == pytest.approx(0.02)
    assert doc["tuned"]["verdict"] == "pass"
    # 0.08 nats apart: vanilla wobbles past the cap, so no verdict can pass, however close the arm is
    wobble = rec([[[1, -0.18], [2, -2.5]], [[1, -0.69], [2, -0.70]]])
    arms["vanilla"] = [_result("vanilla", 0, {1: {"requests": [ref]}, 2: {"requests": [wobble]}})]
    doc = agreement.forced_agreement(arms, 1, caps)
    assert doc["spread_within_caps"] is False and doc["tuned"]["verdict"] == "inconclusive"
    assert "vanilla's own spread is past the caps" in doc["tuned"]["why"]
    assert agreement.verdict(doc, ("tuned",)) == "inconclusive"
    # one process and one batch size: no spread, the caps alone
    solo = {"vanilla": [_result("vanilla", 0, {1: {"requests": [ref]}})],
            "tuned": [_result("tuned", 0, {1: {"requests": [tie]}})]}
    doc = agreement.forced_agreement(solo, 1, caps)
    assert doc["spread_within_caps"] is None and doc["tuned"]["verdict"] == "pass"
    assert "the caps alone" in doc["tuned"]["why"]
    hard_arm = {**solo, "tuned": [_result("tuned", 0, {1: {"requests": [hard]}})]}
    assert agreement.forced_agreement(hard_arm, 1, caps)["tuned"]["verdict"] == "fail"


class _Completion:
    def __init__(self, ids: list[int], lps: list[dict]) -> None:
        self.token_ids, self.logprobs = ids, lps


class _FakeEngine:
    """Greedy next token = (last + 1) % 50, except ``flip`` = {(request's first prompt id, context length)} where
    the other token wins; every call logged."""

    def __init__(self, flip: set[tuple[int, int]]) -> None:
        self.flip, self.calls = flip, []

    def generate(self, prompts: list[list[int]], params: list) -> list:
        self.calls.append([(len(p), sp.max_tokens, sp.logprobs) for p, sp in zip(prompts, params, strict=True)])
        outs = []
        for p, sp in zip(prompts, params, strict=True):
            ctx, ids, lps = list(p), [], []
            for _ in range(sp.max_tokens):
                best, other = (ctx[-1] + 1) % 50, (ctx[-1] + 2) % 50
                if (p[0], len(ctx)) in self.flip:
                    best, other = other, best
                ids.append(best)
                lps.append({best: SimpleNamespace(logprob=-0.2), other: SimpleNamespace(logprob=-1.8)})
                ctx.append(best)
            outs.append(SimpleNamespace(outputs=[_Completion(ids, lps if sp.logprobs else None)]))
        return outs


def _sampling(max_tokens: int, logprobs: int | None) -> SimpleNamespace:
    return SimpleNamespace(max_tokens=max_tokens, logprobs=logprobs)


def test_teacher_forcing_restarts_after_a_differing_token() -> None:
    prompts = [[10, 11], [20, 21], [30, 31]]
    vanilla = forced.teacher_forced(_FakeEngine(set()).generate, _sampling, prompts, 2, 6, 2)
    assert vanilla["rounds"] == 1 and [r["forced_from"] for r in vanilla["requests"]] == ["self", "self"]
    assert vanilla["requests"][0]["forced"] == [12, 13, 14, 15, 16, 17]
    # the arm prefers another token after 2 + 3 tokens of request 0's context: that position is kept, and the
    # request starts again from the prompt plus the forced tokens through it
    engine = _FakeEngine({(10, 5)})
    arm = forced.teacher_forced(engine.generate, _sampling, prompts, 2, 6, 2,
                                forced=[r["forced"] for r in vanilla["requests"]], forced_from="vanilla-0")
    r0 = arm["requests"][0]
    assert arm["rounds"] == 2 and r0["prefill_steps"] == [0, 4] and r0["forced_from"] == "vanilla-0"
    assert [t[0][0] for t in r0["top"]] == [12, 13, 14, 16, 16, 17]  # step 3: its own choice, then forced again
    assert engine.calls[1] == [(2 + 4, 2, 2), (2, 6, None), (2, 6, None)]  # the rest run as filler
    doc = agreement.summarize([agreement.compare_requests(v, a) for v, a in
                               zip(vanilla["requests"], arm["requests"], strict=True)], TOL)
    assert doc["first_divergence"] == 3 and doc["hard_mismatches"] == 1 and doc["positions"] == 12


def test_token_clock_and_the_two_tpot_figures() -> None:
    class Processor:
        def process_outputs(self, outputs, engine_core_timestamp=None):
            return len(outputs)

    processor = Processor()
    llm = SimpleNamespace(llm_engine=SimpleNamespace(output_processor=processor))
    with tpot.TokenClock(llm) as clock:
        for step in range(5):
            time.sleep(0.002)
            out = [SimpleNamespace(request_id=r, new_token_ids=[step]) for r in ("a", "b")]
            assert llm.llm_engine.output_processor.process_outputs(out) == 2
    assert "process_outputs" not in vars(processor)  # the class's method again
    rec = clock.record()
    assert rec["steps"] == 5 and rec["requests"] == 2 and rec["tokens"] == 10 and rec["tpot_ms"] >= 1.9
    assert tpot.TokenClock(SimpleNamespace()).__enter__().record() is None  # no engine to clock
    assert tpot.stamps_ms([{"tpot_ms": 2.0}, None, {"tpot_ms": 4.0}, {"tpot_ms": 3.0}]) == 3.0
    assert tpot.compare(10.0, 10.15)["disagree"] is False
    flagged = tpot.compare(10.0, 10.3)
    assert flagged["disagree"] is True and flagged["ratio"] == pytest.approx(1.03)
    assert tpot.compare(10.0, None)["disagree"] is None


def test_without_the_load_hook_an_arm_that_folds_refuses_realistic_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Applied after the engine started, the recipe would leave the fold's W diag(g) of the dummy weights behind."""
    monkeypatch.setattr(weights, "install_load_hook", lambda seed=0: "no DummyModelLoader in this vLLM")
    monkeypatch.delenv("TUNEKIT_FOLD_NORMS", raising=False)
    spec = {"weights": "realistic", "arm": "tuned"}
    with pytest.raises(RuntimeError, match="folds norms at load"):
        weights.weights_before_start(spec)
    assert weights.weights_before_start({**spec, "arm": "vanilla"}) == "no DummyModelLoader in this vLLM"
    monkeypatch.setenv("TUNEKIT_FOLD_NORMS", "0")
    assert weights.weights_before_start(spec) == "no DummyModelLoader in this vLLM"
    assert weights.weights_before_start({"weights": "dummy", "arm": "tuned"}) is None
