"""``tunekit search``'s options that need more than a type: parsed into what ``SearchConfig`` takes, each bad
value one ``UserError`` line (the CLI prints it and exits 2)."""

from __future__ import annotations

from pathlib import Path

from tunekit.errors import UserError


def seed_sources(given: list[Path] | None) -> tuple[Path, ...]:
    """``--seed-from`` as the search takes it: ``auto`` when not given (a GPU with a shipped table only
    re-measures and refines its winners; the entries and fusion decisions are still this search's own
    measurements), nothing for ``none``."""
    if not given:
        return (Path("auto"),)
    if any(str(path) == "none" for path in given):
        if len(given) > 1:
            raise UserError("--seed-from none means no seeds: it cannot be given with other --seed-from values")
        return ()
    return tuple(given)


def parse_restrict(items: list[str], problems: list, backends: list[str]) -> dict[str, tuple[str, ...]]:
    """``--restrict NAME=V1,V2`` options as {tunable: allowed values (text)}, checked against the spaces."""
    from tunekit import backends as registry

    domains: dict[str, set[str]] = {}
    for name in backends:
        backend = registry.get(name)
        for op in sorted({p.op for p in problems}):
            if op in backend.ops:
                for key, values in backend.space(next(p for p in problems if p.op == op)).domains.items():
                    domains.setdefault(key, set()).update(str(v) for v in values)
    out: dict[str, tuple[str, ...]] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"--restrict {item!r}: expected NAME=VALUE[,VALUE...]")
        # an empty value is a value where the domain has one (a plugin's space, say)
        values = tuple(dict.fromkeys(v.strip() for v in text.split(",")))
        if "" in values and "" not in domains.get(key, ()):
            raise UserError(f"--restrict {item!r}: expected NAME=VALUE[,VALUE...]")
        if key not in domains:
            raise UserError(f"--restrict {key}: no selected backend has this tunable "
                            f"(known: {', '.join(sorted(domains))})")
        unknown = [v for v in values if v not in domains[key]]
        if unknown:
            raise UserError(f"--restrict {key}: {unknown} outside its domain {sorted(domains[key])}")
        out[key] = values
    return out


def peers_option(text: str) -> tuple[str, ...] | None:
    """``--peers``: all (None), none (()), or the named peers."""
    from tunekit import backends as registry  # here: the registry imports torch, the CLI's start does not

    words = [w.strip() for w in text.split(",") if w.strip()]
    if words == ["all"]:
        return None
    if words in ([], ["none"]):
        return ()
    unknown = [w for w in words if w not in registry.PEERS]
    if unknown:
        raise UserError(f"--peers {text}: unknown peer {', '.join(unknown)} (known: all, none, "
                        f"{', '.join(registry.PEERS)})")
    return tuple(dict.fromkeys(words))


def default_backends() -> list[str]:
    """Every tuned family usable on this machine (decided in the worker's device)."""
    from tunekit import backends as registry
    from tunekit.measure.device import detect

    device = detect()
    usable = []
    for name in registry.TUNED:
        try:
            backend = registry.get(name)
        except ImportError:
            continue
        if backend.unavailable_reason(device) is None:
            usable.append(name)
    if not usable:
        raise UserError("no tuned backend can run here (no GPU? set TRITON_INTERPRET=1 for the CPU interpreter)")
    return usable
