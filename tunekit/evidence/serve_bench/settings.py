"""What a serve-bench run measures (``Settings``, checked before any process starts) and the model folder
vLLM loads (``config.json`` only: dummy weights, no tokenizer).

Call protocol::

    settings = build_settings(model="qwen3.5-27b", config=None, tables=["runs/x/table.json"], batches=[1, 2])
    model_dir = write_model_dir(out_dir, settings.model_config)

``Settings.key()`` is what a resume must match (``tunekit.evidence.serve_bench.bench``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunekit.errors import UserError
from tunekit.evidence.serve_bench import ARMS, DEFAULT_ARMS, TABLE_ARMS, spec_decode
from tunekit.evidence.serve_bench import first_token as ttft
from tunekit.evidence.serve_bench.agreement import DEFAULT_TOL
from tunekit.evidence.serve_bench.analysis import load_json

#: Architectures vLLM registers for the model types tunekit derives (configs without ``architectures``).
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
}


@dataclass(frozen=True)
class Settings:
    """What a serve-bench run measures; ``key()`` must match for a resume."""

    model: str
    model_config: dict[str, Any] = field(repr=False)
    tables: tuple[str, ...]
    batches: tuple[int, ...] = (1, 2, 4, 8)
    tokens: int = 128
    prompt_len: int = 64
    repeats: int = 5
    processes: int = 3
    arms: tuple[str, ...] = DEFAULT_ARMS
    layers: int | None = None
    gpu_memory_utilization: float = 0.85
    enforce_eager: bool = False
    agree_steps: int = 8
    logprobs: int = 5
    logprob_tol: float = DEFAULT_TOL
    python: str = sys.executable
    runner_timeout_s: float = 3600.0
    #: decode steps profiled per batch size and process (tunekit.evidence.serve_bench.profile); 0: no profile
    profile_steps: int = 0
    #: "dummy" (vLLM's dummy loader), "realistic" (the dummy load, then tunekit.evidence.serve_bench.weights'
    #: seeded recipe) or "checkpoint" (``model_dir``'s own weights through vLLM's loader)
    weights: str = "dummy"
    weights_seed: int = 0
    #: a model folder with a checkpoint (config.json and weights); None: DIR/model with config.json alone
    model_dir: str | None = None
    #: vLLM's speculative decoding in every arm (``"ngram:3"``: tunekit.evidence.serve_bench.spec_decode); None: off
    speculative: str | None = None
    #: the prompts' recipe (runner.make_prompts): "distinct" ids, or "repeat" (a short pattern tiled, which the
    #: n-gram proposer matches: the default with ``speculative``)
    prompts: str = "distinct"
    #: ``--first-token``: prompt lengths whose time to first token is timed on its own (first_token.py); (): off
    first_token: tuple[int, ...] = ()
    first_token_repeats: int = ttft.DEFAULT_REPEATS

    @property
    def max_model_len(self) -> int:
        """The longest prompt + new tokens + a margin, rounded up to 64: small, so the KV cache costs nothing."""
        longest = max(self.prompt_len + max(self.tokens, self.agree_steps), max(self.first_token, default=0) + 1)
        return -(-(longest + 16) // 64) * 64

    def engine(self, model_dir: Path) -> dict[str, Any]:
        """``LLM(**engine)`` arguments; the runner drops those this vLLM lacks (``gdn_prefill_backend``).
        ``model_dir``: the folder of ``write_model_dir`` (``self.model_dir``, a checkpoint, replaces it)."""
        extra: dict[str, Any] = {}
        if self.logprobs > 20:  # vLLM's default max_logprobs: the engine must allow the top-K asked for
            extra["max_logprobs"] = self.logprobs
        return {
            "model": self.model_dir or str(model_dir),
            "load_format": "auto" if self.weights == "checkpoint" else "dummy",
            "skip_tokenizer_init": True, "dtype": "bfloat16",
            "max_model_len": self.max_model_len, "max_num_seqs": max(self.batches),
            "gpu_memory_utilization": self.gpu_memory_utilization, "enforce_eager": self.enforce_eager,
            "seed": 0, "enable_prefix_caching": False,
            # the SM90 default is FlashInfer's JIT GDN prefill, absent where flashinfer is
            "gdn_prefill_backend": "triton", **spec_decode.engine_args(self.speculative), **extra,
        }

    def key(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        for volatile in ("python", "runner_timeout_s", "logprob_tol", "processes"):
            doc.pop(volatile)
        if not self.profile_steps:  # the key of a run without a profile, as before the option existed
            doc.pop("profile_steps")
        if self.weights == "dummy":  # likewise for the weights
            for name in ("weights", "weights_seed", "model_dir"):
                doc.pop(name)
        if self.speculative is None and self.prompts == "distinct":  # likewise for speculative decoding
            doc.pop("speculative")
            doc.pop("prompts")
        if not self.first_token:  # likewise for the first-token mode
            doc.pop("first_token")
            doc.pop("first_token_repeats")
        doc["tables"] = list(self.tables)
        doc["batches"], doc["arms"] = list(self.batches), list(self.arms)
        if self.first_token:
            doc["first_token"] = list(self.first_token)
        return doc


def _text_part(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder fields: a Qwen3.5 vision-language config nests them in ``text_config``."""
    nested = config.get("text_config")
    return nested if config.get("model_type") == "qwen3_5" and isinstance(nested, dict) else config


def vllm_model_config(config: dict[str, Any], layers: int | None = None) -> dict[str, Any]:
    """The ``config.json`` vLLM gets: the model's config, ``layers`` decoder layers kept (with
    ``layer_types``), ``architectures`` and ``torch_dtype`` added where missing, and the Qwen3.5 text
    model's rotary fields as ``rope_parameters`` (the form of the config that ran on the GPU machine;
    the M-RoPE sections are for vision inputs and dropped: text-only positions)."""
    cfg = copy.deepcopy(config)
    text = _text_part(cfg)
    total = text.get("num_hidden_layers")
    if layers is not None:
        if not isinstance(total, int) or not 1 <= layers <= total:
            raise UserError(f"--layers must be 1..{total}, got {layers}")
        text["num_hidden_layers"] = layers
        if isinstance(text.get("layer_types"), list):
            text["layer_types"] = text["layer_types"][:layers]
    model_type = str(cfg.get("model_type"))
    if "architectures" not in cfg and model_type in ARCHITECTURES:
        cfg["architectures"] = [ARCHITECTURES[model_type]]
    cfg.setdefault("torch_dtype", "bfloat16")
    if text.get("model_type", model_type) in ("qwen3_5_text", "qwen3_5", "qwen3_next") \
            and "rope_parameters" not in text and "rope_theta" in text:
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": text.pop("rope_theta")}
        if "partial_rotary_factor" in text:
            rope["partial_rotary_factor"] = text.pop("partial_rotary_factor")
        text["rope_parameters"] = rope
        text.pop("mrope_section", None)
        text.pop("mrope_interleaved", None)
    return cfg


def _model_document(model: str | None, config: Path | None) -> tuple[str, dict[str, Any]]:
    """(name, raw config dict) of a built-in model or a config file, validated by ``load_model``."""
    from tunekit.problems.models import load_model

    if bool(model) == bool(config):
        raise UserError("give one of --model or --config (or --model-dir, a checkpoint)")
    spec = load_model(str(config) if config else model)  # every config error, one line
    if config is None:
        return spec.name, copy.deepcopy(spec.config)  # built-ins are flat text configs
    path = Path(config).expanduser()
    doc = load_json(path / "config.json" if path.is_dir() else path, "model config")
    if "model_type" not in doc and isinstance(doc.get("config"), dict):  # a tunekit model file
        doc = doc["config"]
    return spec.name, doc


def build_settings(model: str | None, config: Path | None, tables: Sequence[Path | str],
                   batches: Sequence[int] = (1, 2, 4, 8), **options: Any) -> Settings:
    """Check everything that can be checked before a process starts; UserError (one line) otherwise."""
    from tunekit import table as table_mod

    arms = tuple(options.pop("arms", DEFAULT_ARMS))
    unknown = [a for a in arms if a not in ARMS]
    if unknown or "vanilla" not in arms or len(set(arms)) != len(arms):
        raise UserError(f"--arms takes vanilla plus any of passthrough, tuned, folded (got {','.join(arms)})")
    arms = tuple(a for a in ARMS if a in arms)  # the round order is fixed
    options["first_token"] = tuple(options.get("first_token") or ())
    # Without a tuned arm (vanilla against passthrough: the plugin's own cost) a table is optional;
    # given, it still feeds the predicted-saving column.
    if not tables and set(TABLE_ARMS) & set(arms):
        raise UserError("give at least one --table (the tuned and folded arms serve it)")
    paths = []
    for t in tables:
        table_mod.load(t)  # missing or corrupt: one error line, before anything starts
        paths.append(str(Path(t).resolve()))
    options = _weights_options(options)
    if options.get("speculative") is not None:
        options["speculative"] = spec_decode.parse_speculative([options["speculative"]])[0]
    options["prompts"] = options.get("prompts") or ("repeat" if options.get("speculative") else "distinct")
    if options["prompts"] not in PROMPTS:
        raise UserError(f"--prompts takes {' or '.join(PROMPTS)}, got {options['prompts']!r}")
    if options.get("model_dir"):
        if config is not None or model:
            raise UserError("--model-dir is the model: give it without --model or --config")
        if options.get("layers") is not None:
            raise UserError("--layers cannot cut a checkpoint's layers (--model-dir): its weights name them all")
        config = Path(options["model_dir"])
    name, doc = _model_document(model, config)
    layers = options.get("layers")
    cfg = vllm_model_config(doc, layers)
    s = Settings(model=name, model_config=cfg, tables=tuple(paths), batches=tuple(batches), arms=arms, **options)
    if not s.batches or any(b < 1 or b > 1024 for b in s.batches) or len(set(s.batches)) != len(s.batches):
        raise UserError(f"--batch takes distinct sizes 1..1024, got {list(s.batches)}")
    if s.tokens < 2:
        raise UserError("--tokens must be at least 2 (TPOT is the difference of a 1-token and a --tokens run)")
    for opt, value, low in (("--prompt-len", s.prompt_len, 1), ("--repeats", s.repeats, 1),
                            ("--processes", s.processes, 1), ("--agree-steps", s.agree_steps, 1),
                            ("--profile-steps", s.profile_steps, 0)):
        if value < low:
            raise UserError(f"{opt} must be at least {low}, got {value}")
    _check_first_token(s)
    if not 0.05 <= s.gpu_memory_utilization <= 0.99:
        raise UserError(f"--gpu-memory-utilization must be in 0.05..0.99, got {s.gpu_memory_utilization}")
    return s


def _check_first_token(s: Settings) -> None:
    """``--first-token`` lengths: distinct, at least 2 tokens (the request's serial number), inside the model's
    positions; ``--first-token-repeats`` enough for an IQR."""
    if not s.first_token:
        return
    positions = _text_part(s.model_config).get("max_position_embeddings")
    top = int(positions) - 1 if isinstance(positions, int) else None
    if len(set(s.first_token)) != len(s.first_token) or any(n < 2 or (top and n > top) for n in s.first_token):
        raise UserError(f"--first-token takes distinct prompt lengths 2..{top or 'the model length'}, "
                        f"got {','.join(map(str, s.first_token))}")
    if s.first_token_repeats < ttft.MIN_REPEATS:
        raise UserError(f"--first-token-repeats must be at least {ttft.MIN_REPEATS}, "
                        f"got {s.first_token_repeats}")


#: ``--prompts`` values (``runner.make_prompts``).
PROMPTS = ("distinct", "repeat")
#: ``--weights`` values (``checkpoint`` is what ``--model-dir`` makes).
WEIGHTS = ("dummy", "realistic")


def _weights_options(options: dict[str, Any]) -> dict[str, Any]:
    """``weights``, ``model_dir`` and the ``logprobs`` that go with them: a checkpoint folder must hold a
    config.json and weight files; ``logprobs`` defaults to 5 on dummy weights (as before the option) and to
    20 otherwise (vLLM's default ``max_logprobs``: the top-K of the KL)."""
    out = dict(options)
    weights = out.get("weights") or "dummy"
    model_dir = out.get("model_dir")
    if weights not in WEIGHTS and not (weights == "checkpoint" and model_dir):
        raise UserError(f"--weights takes {' or '.join(WEIGHTS)}, got {weights!r}")
    if model_dir:
        if weights not in ("dummy", "checkpoint"):
            raise UserError("--weights is for the dummy loader; --model-dir loads the checkpoint's own weights")
        path = Path(model_dir).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise UserError(f"--model-dir {model_dir}: no config.json there")
        if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")) and not any(path.glob("*.pt")):
            raise UserError(f"--model-dir {model_dir}: no weight files (*.safetensors, *.bin, *.pt) there")
        out["model_dir"], weights = str(path), "checkpoint"
    out["weights"] = weights
    if out.get("logprobs") is None:
        out["logprobs"] = 5 if weights == "dummy" else 20
    return out


def parse_sizes(text: str, option: str) -> list[int]:
    """``"1,2,4,8"`` -> [1, 2, 4, 8] (batch sizes, concurrencies); UserError naming ``option`` otherwise."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"bad {option} {text!r}: expected a comma list such as 1,2,4,8") from None
    if not values or any(v < 1 for v in values) or len(set(values)) != len(values):
        raise UserError(f"bad {option} {text!r}: expected distinct positive integers")
    return values


def write_model_dir(out_dir: Path, config: dict[str, Any]) -> Path:
    """``DIR/model/config.json``: all vLLM reads with dummy weights and no tokenizer."""
    model_dir = Path(out_dir) / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return model_dir


def vocab_size(config: dict[str, Any]) -> int:
    """The model's vocabulary (the runner's prompts stay inside it); 32000 where the config has none."""
    return int(_text_part(config).get("vocab_size", 32000))
