"""Pure renderers of presets for the side panel: the active preset's line and the list of all.

A preset file is the user's (``--preset path.toml``, the "Load" box), so its name and
description are escaped like model output: they are shown, never interpreted.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from localspec.config import Preset
from localspec.models.hardware import PresetSummary


def preset_info_html(preset: Preset | None) -> str:
    """One paragraph on ``preset``: name, description, models, method and k."""
    if preset is None:
        return ""
    sc = preset.speculative_config
    draft = f" + draft <code>{html.escape(sc.model)}</code>" if sc.model else ""
    return (f'<div class="ls-preset-info"><b>{html.escape(preset.name)}</b>: '
            f"{html.escape(preset.description)}<br>target "
            f"<code>{html.escape(preset.target.model)}</code> "
            f"({html.escape(preset.target.quantization)}){draft}, method "
            f"<code>{html.escape(sc.method)}</code>, k ≤ {sc.num_speculative_tokens}</div>")


def presets_html(rows: Sequence[PresetSummary], machine: str) -> str:
    """Every shipped preset grouped by hardware class, with whether it fits ``machine``."""
    parts = [f"<p><b>This machine:</b> {html.escape(machine)}</p>"]
    group = None
    items: list[str] = []
    for row in rows:
        if row.hardware != group:
            if items:
                parts.append(f"<ul>{''.join(items)}</ul>")
                items = []
            group = row.hardware
            parts.append(f"<p><b>{html.escape(group)}</b></p>")
        mark = "✓" if row.fits else "✗"
        detail = row.error or row.reason
        items.append(f"<li>{mark} <code>{html.escape(row.key)}</code>: "
                     f"{html.escape(detail)}</li>")
    if items:
        parts.append(f"<ul>{''.join(items)}</ul>")
    return f'<div class="ls-presets">{"".join(parts)}</div>'


def api_html(url: str | None, key_needed: bool) -> str:
    """Where the OpenAI-compatible API of this server is ("" when it is not served)."""
    if url is None:
        return ""
    address = html.escape(url)
    key = " (send your API key as a Bearer token)" if key_needed else ""
    return (f'<div class="ls-api">OpenAI-compatible API: <code>{address}</code>{key}: point '
            f"any OpenAI client at it, e.g. <code>OpenAI(base_url=\"{address}\", "
            "api_key=\"…\")</code></div>")
