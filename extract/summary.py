"""The table printed at the end of an extract run."""

from __future__ import annotations

from shared.manifest import Manifest

LISTED_REJECTS = 5


def format_summary(manifest: Manifest, *, seconds: float) -> str:
    t = manifest.totals()
    raw = t["tokens"] * len(manifest.layer_ids) * manifest.target.hidden_size * 2
    rows = [
        ("cache", manifest.config.get("out", "")),
        ("complete", f"{manifest.complete} ({t['parts']}/{manifest.num_units} parts)"),
        (
            "target",
            f"{manifest.target.path} ({manifest.target.model_type}, "
            f"{manifest.target.num_layers} layers, hidden {manifest.target.hidden_size})",
        ),
        ("layers", ", ".join(map(str, manifest.layer_ids))),
        ("format / store", f"{manifest.format} / {manifest.store}"),
        ("rows read", f"{t['rows_read']:,}"),
        ("rows kept", f"{t['rows_kept']:,} ({t['rows_truncated']:,} truncated)"),
        ("rows rejected", f"{t['rows_rejected']:,}"),
    ]
    rows += [(f"  {reason}", f"{n:,}") for reason, n in t["rejected"].items()]
    first = [r for p in manifest.parts for r in p.rejected_rows][:LISTED_REJECTS]
    rows += [
        ("  first rejected" if i == 0 else "", f"{r.source}:{r.line}: {r.reason}")
        for i, r in enumerate(first)
    ]
    if t["rows_rejected"] > len(first):
        rows.append(("", f"... all of them in {manifest.config.get('out', '')}/manifest.json"))
    rows += [
        ("tokens", f"{t['tokens']:,} ({t['supervised_tokens']:,} supervised)"),
        (
            "on disk",
            f"{t['nbytes'] / 1e6:,.1f} MB ({t['nbytes'] / max(t['tokens'], 1):,.0f} B/token,"
            f" ratio {raw / max(t['nbytes'], 1):.2f} vs raw bf16)",
        ),
        ("time", f"{seconds:,.1f} s this run"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
