"""A few layers of a Hugging Face model at real sizes, decoded eagerly and as a graph.

Models (:data:`MODELS`): ``qwen3.5-27b`` (``Qwen3_5ForCausalLM``) and ``llama-3.1-8b``
(``LlamaForCausalLM``) with the sizes of ``tunekit/problems/models/configs/*.json`` but ``layers`` decoder layers
(Qwen3.5: the model's own layer pattern; if it has no full-attention layer the last layer becomes one, so
both token mixers run), BF16 random weights (seeded). ``tiny`` shrinks the sizes for the CPU test under
the Triton interpreter.

Eager decode (:func:`decode`): HF's default cache (``DynamicCache``), one token per forward.

Graphed decode (:class:`StepDecoder` with ``graphed=True``), the Hugging Face-native way: a
``transformers.StaticCache`` (fixed-size KV tensors marked as static addresses; Qwen3.5's linear-attention
layers keep their fixed-size conv / recurrent states in it) and the model's forward under
``torch.compile(mode="reduce-overhead", fullgraph=True)``, which Inductor runs as CUDA graphs
(cudagraph trees: the first calls warm up eagerly, then one decode step is captured and replayed). This
is what ``generate(cache_implementation="static")`` compiles, and it works with the model classes of
transformers 5.17 and 5.24 for both models, patched or not (one graph, no graph break, no cudagraph skip
on the H200), so it is used rather than a hand-made ``torch.cuda.CUDAGraph`` capture, which would have
to re-implement what HF's forward does outside the traced tensors (mask and position set-up).
Patch before compiling: compiled code keeps the forwards it traced, and ``tunekit.ops`` must have built
its kernels before the capture (:func:`tunekit.ops.prepare`, and the eager warm-up calls).

Recipe, outside this check::

    tunekit.patch(model, table=...)                        # or leave it unpatched
    cache = StaticCache(config=model.config, max_cache_len=prompt_len + new_tokens)
    logits = model(prompt, past_key_values=cache, use_cache=True).logits        # prefill, eager
    token = logits[:, -1].argmax(-1, keepdim=True)
    step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    for pos in range(prompt_len, prompt_len + new_tokens):
        torch.compiler.cudagraph_mark_step_begin()
        logits = step(input_ids=token, position_ids=torch.tensor([[pos]]), past_key_values=cache,
                      use_cache=True).logits
        token = logits[:, -1].argmax(-1, keepdim=True)                          # copy before the next step
"""

from __future__ import annotations

import copy
import inspect
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tunekit.errors import UserError
from tunekit.evidence.check_serving.checks import sync

#: The built-in model configs (``tunekit/problems/models/configs``).
CONFIGS = Path(__file__).resolve().parents[2] / "problems" / "models" / "configs"

#: Model name -> built-in config file (its "config" block is the Hugging Face config).
MODELS: dict[str, str] = {"qwen3.5-27b": "qwen3.5-27b.json", "llama-3.1-8b": "llama-3.1-8b-instruct.json"}

#: Sizes of the tiny models (CPU test under the Triton interpreter); everything else as the real model.
#: Every K is >= 128: the search's default GEMV config (BLOCK_K 256) is invalid for K < 128, and
#: tunekit search stops on it.
TINY: dict[str, dict[str, Any]] = {
    "qwen3.5-27b": {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                    "linear_value_head_dim": 32},
    "llama-3.1-8b": {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
}
#: M-RoPE sections of the tiny Qwen3.5: they sum to head_dim * partial_rotary_factor / 2 = 32 * 0.25 / 2.
TINY_MROPE_SECTION = [2, 1, 1]


def check_model_name(name: str) -> str:
    if name not in MODELS:
        raise UserError(f"unknown model {name!r} for check-serving (known: {', '.join(MODELS)})")
    return name


def require_transformers() -> None:
    """One clear error when transformers (the ``hf`` extra) is missing."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise UserError("the model check needs transformers: pip install -e '.[hf]'") from None


def layer_types(pattern: Sequence[str], layers: int) -> list[str]:
    """The first ``layers`` of the model's pattern; the last one made full attention if none is."""
    types = list(pattern[:layers])
    while len(types) < layers:
        types.append(pattern[len(types) % len(pattern)])
    if layers and "full_attention" not in types:
        types[-1] = "full_attention"
    return types


def config_kwargs(model: str, layers: int, tiny: bool) -> dict[str, Any]:
    """Config arguments of the HF class: the real sizes from the built-in config (or TINY), ``layers`` layers."""
    cfg = json.loads((CONFIGS / MODELS[check_model_name(model)]).read_text())["config"]
    common = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "rms_norm_eps", "hidden_act", "attention_bias", "tie_word_embeddings",
              "max_position_embeddings")
    kw: dict[str, Any] = {name: cfg[name] for name in common}
    if model == "qwen3.5-27b":
        for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim"):
            kw[name] = cfg[name]
        rope = {"rope_type": "default", "rope_theta": float(cfg["rope_theta"]),
                "partial_rotary_factor": float(cfg["partial_rotary_factor"]),
                "mrope_section": list(cfg["mrope_section"]), "mrope_interleaved": bool(cfg["mrope_interleaved"])}
        if tiny:
            rope["mrope_section"] = list(TINY_MROPE_SECTION)
        kw["layer_types"] = layer_types(cfg["layer_types"], layers)
    else:
        kw["mlp_bias"] = cfg["mlp_bias"]
        rope = {"rope_theta": float(cfg["rope_theta"]), **cfg["rope_scaling"]}
    if tiny:
        kw.update(TINY[model])
    kw["num_hidden_layers"] = layers
    kw["rope_parameters"] = rope
    return kw


def _classes(model: str) -> tuple[Any, Any]:
    require_transformers()
    if model == "qwen3.5-27b":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        return Qwen3_5TextConfig, Qwen3_5ForCausalLM
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaConfig, LlamaForCausalLM


def build_config(model: str, layers: int, tiny: bool) -> Any:
    config_cls, _ = _classes(model)
    return config_cls(**config_kwargs(model, layers, tiny))


def meta_model(model: str, config: Any) -> torch.nn.Module:
    """The model on the meta device (no weights allocated): for its shapes only."""
    _, model_cls = _classes(model)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            return model_cls(config)
    finally:
        torch.set_default_dtype(previous)


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Seeded random weights, independent of the transformers version's own init.

    Linear / Embedding N(0, 0.02) (HF's initializer_range: logits of std ~1.4 at the 27B sizes, not
    degenerate); norms by the tunekit op that serves them: zero-centred (1 + w) w ~ N(0, 0.1), plain and
    gated w ~ 1 + N(0, 0.1), so a w / (1 + w) mix-up shows; conv1d U(-0.5, 0.5) (PyTorch's default bound
    for 4 taps); dt_bias 1 and A_log = log U(0.01, 16) as HF initialises them.
    """
    from tunekit.integrations.torch_patch import ELEMENTWISE_ROUTES

    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            kind = type(module).__name__
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                module.weight.normal_(0.0, 0.02, generator=gen)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, torch.nn.Conv1d):
                module.weight.uniform_(-0.5, 0.5, generator=gen)
                if module.bias is not None:
                    module.bias.zero_()
            elif kind in ELEMENTWISE_ROUTES or kind.endswith("RMSNorm"):
                centre = 0.0 if ELEMENTWISE_ROUTES.get(kind) == "gemma_rms_norm" else 1.0
                module.weight.normal_(centre, 0.1, generator=gen)
            elif kind.endswith("GatedDeltaNet"):
                module.dt_bias.fill_(1.0)
                a = torch.empty(module.A_log.shape, device=device, dtype=torch.float32)
                module.A_log.copy_(a.uniform_(0.01, 16, generator=gen).log())


def build_model(model: str, config: Any, device: torch.device, seed: int) -> torch.nn.Module:
    _, model_cls = _classes(model)
    torch.manual_seed(seed)
    with torch.device(device):
        built = model_cls._from_config(config, dtype=torch.bfloat16)
    built = built.to(device)  # parameters are BF16 already; buffers (rotary inv_freq) keep their fp32
    init_weights(built, seed)
    return built.eval()


def shared_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A second module tree over the same parameters and buffers (to patch one and not the other)."""
    memo: dict[int, Any] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def _norm_shape_arg(module: torch.nn.Module, op: str) -> str:
    size = module.weight.shape[0]
    # HF calls the gated norm on [tokens * heads, head_dim]: one group of head_dim per row, so the op's
    # table key is (m = tokens * heads, n = head_dim, k = head_dim), i.e. gated_rms_norm:1xHEAD_DIM.
    return f"gated_rms_norm:1x{size}" if op == "gated_rms_norm" else f"{op}:{size}"


def shape_args(model: str, config: Any, only: str = "all") -> list[str]:
    """``--shape`` values covering the HF model: its linears (NxK) and its routed norms (OP:SIZE); with
    ``only="rms_gemv"``, the linears a folded norm feeds (``rms_gemv:NxK``, ``patch(fold_norms=True)``);
    with ``only="merged"``, the merged siblings' GEMVs (``patch(merge_siblings=True)``: vLLM's shapes)."""
    from tunekit.integrations.torch_patch import ELEMENTWISE_ROUTES, fold_shapes, linear_shapes, merged_shapes

    meta = meta_model(model, config)
    if only == "rms_gemv":
        return [f"rms_gemv:{n}x{k}" for n, k in fold_shapes(meta)]
    if only == "merged":
        return [f"{n}x{k}" for n, k in merged_shapes(meta)]
    out: list[str] = []
    if only in ("all", "gemv"):
        out += [f"{row['n']}x{row['k']}" for row in linear_shapes(meta)]
    if only in ("all", "norms"):
        for module in meta.modules():
            op = ELEMENTWISE_ROUTES.get(type(module).__name__)
            if op is not None:
                arg = _norm_shape_arg(module, op)
                if arg not in out:
                    out.append(arg)
    return out


def decode_norm_calls(model: str, config: Any) -> list[dict[str, Any]]:
    """The routed norm calls of one decode step (batch 1): op, table (m, n, k) and what they are."""
    hidden = config.hidden_size
    if model != "qwen3.5-27b":
        return [{"op": "rms_norm", "m": 1, "n": hidden, "k": hidden, "what": "input/post-attention/final norm"}]
    head_dim = config.head_dim
    types = list(config.layer_types)
    calls = [{"op": "gemma_rms_norm", "m": 1, "n": hidden, "k": hidden, "what": "input/post-attention/final norm"}]
    if "full_attention" in types:
        calls.append({"op": "gemma_rms_norm", "m": config.num_key_value_heads, "n": head_dim, "k": head_dim,
                      "what": "self_attn.k_norm"})
        calls.append({"op": "gemma_rms_norm", "m": config.num_attention_heads, "n": head_dim, "k": head_dim,
                      "what": "self_attn.q_norm (a row-strided view of q_proj's output)"})
    if "linear_attention" in types:
        dv = config.linear_value_head_dim
        calls.append({"op": "gated_rms_norm", "m": config.linear_num_value_heads, "n": dv, "k": dv,
                      "what": "linear_attn.norm ([heads, head_v_dim] rows)"})
    return calls


def cache_kwarg(model: torch.nn.Module) -> str:
    """transformers >= 5.2x names the cache ``cache``; 5.17 ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def decode(model: torch.nn.Module, prompt: torch.Tensor, steps: int, forced: Sequence[int] | None = None,
           stats: bool = False) -> dict[str, Any]:
    """Eager greedy decode of ``steps`` tokens (logits of step 0 from the prefill), teacher-forced with ``forced``.

    Returns the fp32 logits of every step (CPU), the argmax tokens and, with ``stats``, the dispatch markers
    of the prefill and of the decode steps apart.
    """
    from tunekit import ops

    kw = cache_kwarg(model)
    device = prompt.device
    logits: list[torch.Tensor] = []
    tokens: list[int] = []
    result: dict[str, Any] = {}
    with torch.no_grad():
        if stats:
            ops.reset_stats()
        out = model(prompt, use_cache=True)
        cache = _cache_of(out)
        if stats:
            result["stats_prefill"] = ops.dispatch_stats(reset=True)
        for step in range(steps):
            step_logits = out.logits[0, -1].float()
            logits.append(step_logits.cpu())
            tokens.append(int(step_logits.argmax()))
            if step == steps - 1:
                break
            feed = forced[step] if forced is not None else tokens[-1]
            ids = torch.tensor([[feed]], dtype=torch.long, device=device)
            out = model(ids, use_cache=True, **{kw: cache})
            cache = _cache_of(out)
        sync(device)
        if stats:
            result["stats_decode"] = ops.dispatch_stats(reset=True)
    result.update(logits=logits, tokens=tokens)
    return result


class StepDecoder:
    """One decode step at a time over a ``StaticCache``: eager, or graphed (compiled, reduce-overhead).

    ``prefill(prompt)`` runs the prompt eagerly into the cache (made at the first prefill, reset later);
    ``step(token)`` decodes one token at the next position and returns the last position's logits (BF16,
    on the device; the graphed variant's output is the graph's buffer, valid until the next step). All
    four timed variants use the same cache type, so their ratios isolate patching and graphing.
    """

    def __init__(self, model: torch.nn.Module, max_cache_len: int, graphed: bool) -> None:
        require_transformers()
        self.model = model
        self.max_cache_len = max_cache_len
        self.graphed = graphed
        self.kw = cache_kwarg(model)
        self.forward = (torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) if graphed
                        else model.forward)
        self.cache: Any = None
        self.pos = 0

    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        from transformers import StaticCache

        if self.cache is None:
            self.cache = StaticCache(config=self.model.config, max_cache_len=self.max_cache_len)
        else:  # the same tensors again (static addresses: the captured graph stays valid)
            self.cache.reset()
        with torch.no_grad():
            out = self.model(prompt, use_cache=True, **{self.kw: self.cache})
        self.pos = prompt.shape[1]
        return out.logits[0, -1]

    def step(self, token: int) -> torch.Tensor:
        if self.pos >= self.max_cache_len:
            raise RuntimeError(f"static cache full ({self.max_cache_len} positions)")
        device = next(self.model.parameters()).device
        ids = torch.tensor([[token]], dtype=torch.long, device=device)
        position = torch.tensor([[self.pos]], dtype=torch.long, device=device)
        if self.graphed:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            out = self.forward(input_ids=ids, position_ids=position, use_cache=True, **{self.kw: self.cache})
        self.pos += 1
        return out.logits[0, -1]

    def decode(self, prompt: torch.Tensor, steps: int, forced: Sequence[int] | None = None) -> dict[str, Any]:
        """Greedy decode like :func:`decode` (step 0 from the prefill), teacher-forced with ``forced``."""
        logits: list[torch.Tensor] = []
        tokens: list[int] = []
        step_logits = self.prefill(prompt).float().cpu()
        for step in range(steps):
            logits.append(step_logits)
            tokens.append(int(step_logits.argmax()))
            if step == steps - 1:
                break
            feed = forced[step] if forced is not None else tokens[-1]
            step_logits = self.step(feed).float().cpu()  # copied before the next replay overwrites it
        return {"logits": logits, "tokens": tokens}


def time_interleaved(decoders: dict[str, StepDecoder], prompt: torch.Tensor, warmup: int, iters: int,
                     rounds: int) -> dict[str, list[list[float]]]:
    """Per-step times (ms) of each variant, interleaved: ``rounds`` rounds, each variant ``iters`` steps a round.

    Each variant prefills once, then runs ``warmup`` untimed steps; in every round the variants take turns
    (the order rotates per round), each timing ``iters`` consecutive decode steps (CUDA events around each
    step, synchronized before it; the greedy token of a step feeds the next). Returns
    {variant: [[ms per step] per round]}.
    """
    device = prompt.device
    names = list(decoders)
    times: dict[str, list[list[float]]] = {name: [] for name in names}
    tokens: dict[str, int] = {}
    for name, dec in decoders.items():
        tokens[name] = int(dec.prefill(prompt).argmax())
        for _ in range(warmup):
            tokens[name] = int(dec.step(tokens[name]).argmax())
    sync(device)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            dec, row = decoders[name], []
            for _ in range(iters):
                sync(device)
                if device.type == "cuda":
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    logits = dec.step(tokens[name])
                    end.record()
                    torch.cuda.synchronize(device)
                    row.append(start.elapsed_time(end))
                else:
                    import time

                    t0 = time.perf_counter()
                    logits = dec.step(tokens[name])
                    row.append((time.perf_counter() - t0) * 1e3)
                tokens[name] = int(logits.argmax())
            times[name].append(row)
    return times
