"""The preset side of the page: the status line, the preset picker's choices and table, a
switch to another preset, and the sampling controls a preset sets.

A switch loads in the background with progress and keeps the old preset when the new one fails
(the picker goes back to it and the status line says why); it waits first for a load already
under way (the start-up load, or another tab's switch). Views come from the pure renderers
(``render.status_html``, ``preset_view``); nothing here generates.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from localspec.errors import LocalSpecError
from localspec.files import replace_lone_surrogates
from localspec.host import ModelHost
from localspec.models.hardware import Hardware, survey_presets
from localspec.presets import Preset, load_preset
from localspec.ui.preset_view import preset_info_html, presets_html
from localspec.ui.render import status_html
from localspec.ui.views import SwitchView, view


class PresetHandlers:
    """The preset handlers over ``host``, on ``hardware``; ``default_preset`` is what a page
    shows before anything is loaded."""

    def __init__(self, host: ModelHost, hardware: Hardware, default_preset: str) -> None:
        self.host = host
        self.hardware = hardware
        self.default_preset = default_preset

    def status(self) -> str:
        """The status line: the active preset, or the load under way, or what failed."""
        st = self.host.status()
        return status_html(st.active_title, st.active, st.loading, st.message, st.fraction,
                           st.error)

    def choices(self) -> list[tuple[str, str]]:
        """The picker's (label, key) pairs; one that does not fit this machine says why."""
        return [(row.title if row.fits else f"{row.title} — ✗ {row.reason}", row.key)
                for row in survey_presets(self.hardware)]

    def table_html(self) -> str:
        """Every preset and whether it fits this machine."""
        return presets_html(survey_presets(self.hardware), self.hardware.describe())

    def switch(self, key: str | None) -> Iterator[SwitchView]:
        """Load another preset (a name or a .toml path) with progress; keep the old on failure.
        A typed name's lone surrogates become U+FFFD: no preset has them, and its error is shown."""
        key = replace_lone_surrogates((key or "").strip())
        while self.host.is_loading():  # the start-up load, or another tab's switch
            yield view(SwitchView, status=self.status())
            self.host.wait_loaded(0.5)
        st = self.host.status()
        if not key or (key == st.active and st.error is None):
            yield view(SwitchView, status=self.status())
            return
        thread = self.host.load_async(key)
        while thread.is_alive():
            yield view(SwitchView, status=self.status())
            thread.join(0.5)
        st = self.host.status()
        pipe = self.host.pipeline
        if st.active != key or pipe is None:  # failed: the dropdown goes back to the active one
            yield view(SwitchView, status=self.status(), preset=st.active)
            return
        listed = {value for _, value in self.choices()}
        yield self._controls(pipe.preset, status=self.status(),
                             preset=key if key in listed else None, method="preset")

    def initial_controls(self) -> SwitchView:
        """The sampling controls from the active (or the default) preset when a page opens."""
        pipe = self.host.pipeline
        if pipe is not None:
            return self._controls(pipe.preset)
        try:
            return self._controls(load_preset(self.default_preset))
        except LocalSpecError:  # no such preset: the page opens with the config's defaults
            return view(SwitchView)

    @staticmethod
    def _controls(p: Preset, **fields: Any) -> SwitchView:
        """The controls set to preset ``p``'s values (and any other ``fields``)."""
        s = p.sampling
        return view(SwitchView, info=preset_info_html(p), temperature=s.temperature,
                    top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens,
                    k=p.speculative_config.num_speculative_tokens, seed=s.seed, **fields)
