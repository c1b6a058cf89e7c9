"""Params files into a :class:`~rlver_lib.config.RunConfig` and back (docs/ARCHITECTURE.md
"Code map").

A params file (``params/*.yaml``) may start from another with ``base: other.yaml`` (deep
merge, :func:`load_params`); dotted overrides (``training.steps=4``) come from the
command line (``rlver run P.yaml --set key=value``) and from papermill parameters
(:func:`build_config`). A run folder's saved ``config.yaml`` is read back through
:func:`load_run_config`, which also reads old folders (:func:`upgrade_run_config`).

Errors: :func:`load_config` raises :class:`~rlver_lib.config.ConfigError` naming the file
and the offending key (for example ``params/x.yaml: training.stepz: unknown key 'stepz'
in training (did you mean steps?); valid keys: ...``), or the override that caused it
(``--set training.stepz=4: unknown key 'stepz' in training ...``); a removed key names
what replaced it (:data:`RETIRED_KEYS`), a never-used one why (:data:`UNUSED_KEYS`).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, get_args

import yaml
from pydantic import BaseModel, ValidationError

from rlver_lib.config import RENAMED_STAGES, AnnotatorConfig, ConfigError, RunConfig, UserModelConfig


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{key}: '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """Split ``key=value``; the value is parsed as YAML (``4``, ``true``, ``[a, b]``).

    Raises :class:`ConfigError` when there is no ``=``.
    """
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    key, raw = item.split("=", 1)
    return key.strip(), yaml.safe_load(raw) if raw.strip() else None


@dataclass(frozen=True)
class Retired:
    """One entry of :data:`RETIRED_KEYS`: ``use``, what a params file that sets the key is
    told to write instead; ``read``, the value an old run folder saved as the current
    keys it means (``{dotted key: value}``; empty: nothing to set)."""

    use: str
    read: Callable[[Any], dict[str, Any]]


def _renamed(new: str) -> Retired:
    """A key (or a whole section) now called ``new``: its value moves there."""
    return Retired(f"use {new}", lambda value: {new: value})


def _off_switch(off: dict[str, Any]) -> Retired:
    """A bool that switched a part off, retired for the part's counts (docs/ARCHITECTURE.md
    "Config conventions"): ``false`` reads as the values ``off`` (counts at 0, no tasks),
    ``true`` as nothing (the counts keep theirs)."""
    spelled = " and ".join(f"{key}: {json.dumps(value)}" for key, value in off.items())
    return Retired(f"{spelled} switches the part off", lambda on: {} if on else dict(off))


RETIRED_KEYS: dict[str, Retired] = {
    "evaluation.n_scenarios": _renamed("scenarios.n_test_scenarios"),
    **{f"training.{name}": _renamed(f"training.ppo.{name}")
       for name in ("value_learning_rate", "value_clip_eps", "vf_coef", "gamma", "lam", "whiten_advantages")},
    "scenarios.limit_train": _renamed("scenarios.n_train_scenarios"),
    "scenarios.limit_test": _renamed("scenarios.n_test_scenarios"),
    "evaluation.bootstrap_samples": _renamed("evaluation.n_boot"),
    "analysis.judge": _renamed("analysis.annotator"),
    "analysis.judge_sample": _renamed("analysis.n_annotated_replies"),
    "analysis.self_agreement_sample": _renamed("analysis.n_self_agreement_replies"),
    "analysis.judge_seeds": _renamed("analysis.n_self_agreement_runs"),
    "analysis.judge_validation_n": _renamed("analysis.n_annotator_validation_items"),
    "analysis.probe_scenarios": _renamed("analysis.n_probe_scenarios"),
    "analysis.sycophancy_samples": _renamed("analysis.n_sycophancy_replies"),
    "analysis.consistency_sample": _renamed("analysis.n_consistency_turns"),
    "capability.humaneval_n": _renamed("capability.n_humaneval_problems"),
    "capability.math_n": _renamed("capability.n_math_items"),
    # the off-switches last: an old run's false wins over the count it saved beside it
    "analysis.strategy_judge": _off_switch({"analysis.n_annotated_replies": 0, "analysis.n_sycophancy_replies": 0}),
    "analysis.hacking_probes": _off_switch({"analysis.n_probe_scenarios": 0}),
    "capability.enabled": _off_switch({"capability.n_humaneval_problems": 0, "capability.n_math_items": 0,
                                       "capability.lm_eval.tasks": []}),
    "capability.lm_eval.enabled": _off_switch({"capability.lm_eval.tasks": []}),
}
"""The one migration table: every key retired since 2 December 2026, ``{old dotted key:
what replaced it}`` (docs/ARCHITECTURE.md "Config conventions"). A params file or
override that sets one is refused, naming what to write instead; a run folder's saved
``config.yaml`` written since that date is read through it, entry by entry in this
order (:func:`upgrade_run_config`), so the run reads as it ran. Older run folders are
not promised: one holding a key retired before that date is refused, naming the key."""

UNUSED_KEYS: dict[str, str] = {
    "evaluation.judge.initial_emotion": "the judge never used it: the benchmark starts at evaluation.initial_emotion",
    "analysis.annotator.initial_emotion": "the strategy annotator never used it: dialogues start at "
                                          "simulator.initial_emotion (training) and evaluation.initial_emotion "
                                          "(the benchmark)",
    **{f"analysis.annotator.{name}": "the strategy annotator never used it: it is a simulated user's setting, "
                                     "of simulator and evaluation.judge"
       for name in UserModelConfig.model_fields if name not in AnnotatorConfig.model_fields},
}
"""Keys that earlier versions accepted, and wrote into every run's ``config.yaml``, but
never used (the judge and the strategy annotator were whole simulator configs then):
``{key: why}``, under the keys' current names (:data:`RETIRED_KEYS` renames first).  A
params file or override that sets one is refused with the reason; :func:`load_run_config`
drops them from an old run's ``config.yaml``."""

ADDED_KEYS: dict[str, Any] = {
    "capability.batch_size": 8,
    **{f"{section}.speculative": "none" for section in ("simulator", "evaluation.judge", "analysis.annotator")},
}
"""Keys added since runs were first saved, with the value that a run saved before a key
existed ran with: ``{key: value}``. :func:`saved_run_config` writes it where an old
``config.yaml`` lacks the key (and its section is there), so the run reads as it ran: it
resumes unchanged where today's default is that value, and a resume whose value
differs names the key (an old quickstart ran its capability prompts 8 at a time; today's
default is 16)."""


def _key_note(loc: str) -> str:
    """`` (removed: use <key>)`` for a :data:`RETIRED_KEYS` key, `` (<why>)`` for an
    :data:`UNUSED_KEYS` one, else empty."""
    if loc in RETIRED_KEYS:
        return f" (removed: {RETIRED_KEYS[loc].use})"
    if loc in UNUSED_KEYS:
        return f" ({UNUSED_KEYS[loc]})"
    return ""


def _section_model(parts: list[str]) -> type[BaseModel] | None:
    """The config model of the section at dotted ``parts`` (``[]``: :class:`RunConfig`),
    ``None`` when no such section exists."""
    model: type[BaseModel] | None = RunConfig
    for part in parts:
        field = model.model_fields.get(part) if model else None
        if field is None:
            return None
        model = _model_in(field.annotation)
    return model


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):  # ``AnnotatorConfig | None``
        found = _model_in(arg)
        if found:
            return found
    return None


def _unknown_key_hint(loc: str) -> str:
    """``unknown key 'stepz' in training (did you mean steps?); valid keys: ...``."""
    *section, name = loc.split(".")
    model = _section_model(section)
    where = f"in {'.'.join(section)}" if section else "at the top level"
    text = f"unknown key '{name}' {where}"
    if _key_note(loc):
        return text + _key_note(loc)
    if model is None:
        return text
    valid = list(model.model_fields)
    close = difflib.get_close_matches(name, valid, n=3)
    if close:
        text += f" (did you mean {' or '.join(close)}?)"
    return text + f"; valid keys: {', '.join(valid)}"


def _override_of(loc: str, kind: str, overrides: dict[str, str]) -> str | None:
    """The label of the override an error at ``loc`` comes from, ``None`` when it comes
    from the params data: the override set ``loc`` or a section above it, or (an unknown
    key) created the unknown section ``loc`` on its way down."""
    for key, label in overrides.items():
        if key == loc or loc.startswith(key + ".") or (
                kind == "extra_forbidden" and key.startswith(loc + ".")):
            return label
    return None


def _format_error(source: str, err: ValidationError, overrides: dict[str, str] | None = None) -> str:
    """One line per error: ``<source>: <key>: <message>`` for the params data, or
    ``--set <key>=<value>: ...`` for an override; an unknown key, in either, with the
    closest valid keys and all of the section's (:func:`_unknown_key_hint`). A check of
    a whole section (or of the whole config) names the params data and the overrides
    set inside it: ``<source> with --set <key>=<value>: <section>: <message>``."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        label = _override_of(loc, e["type"], overrides or {}) if e["loc"] else None
        if label is None:
            detail = _unknown_key_hint(loc) if e["type"] == "extra_forbidden" else e["msg"]
            # a check of a whole section (or of the config) may fail for an override set below it
            below = [text for key, text in (overrides or {}).items()
                     if e["type"] != "extra_forbidden" and (not e["loc"] or key.startswith(loc + "."))]
            lines.append(f"{source}{' with ' + ', '.join(below) if below else ''}: {loc}: {detail}")
        elif e["type"] == "extra_forbidden":
            lines.append(f"{label}: {_unknown_key_hint(loc)}")
        else:
            lines.append(f"{label}: {loc}: {e['msg']}")
    return "\n".join(lines)


def build_config(
    data: dict[str, Any] | None = None,
    overrides: dict[str, Any] | list[str] | None = None,
    source: str = "<config>",
) -> RunConfig:
    """Validate ``data`` with dotted ``overrides`` applied.

    ``overrides`` is a mapping ``{"training.steps": 4}`` or a list of
    ``"key=value"`` strings (``--set``). Raises :class:`ConfigError` naming every bad
    key: an error of the data names ``source``, one an override causes names the
    override (``--set training.stepz=4: unknown key 'stepz' in training (did you mean
    steps?); valid keys: ...``).
    """
    data = json.loads(json.dumps(data or {}))
    if isinstance(overrides, list):  # the command line's ``--set key=value``
        parsed = [(item, *parse_override(item)) for item in overrides]
        labels = {key: f"--set {item.strip()}" for item, key, _ in parsed}
        overrides = {key: value for _, key, value in parsed}
    else:
        labels = {key: f"override {key}" for key in overrides or {}}
    for key, value in (overrides or {}).items():
        try:
            _set_dotted(data, key, value)
        except ConfigError as err:
            raise ConfigError(f"{labels[key]}: {err}") from None
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(source, err, labels)) from None


def merge_params(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """Deep merge of two params mappings: ``overlay`` wins; nested mappings merge key
    by key, every other value (lists included) replaces the base value whole. Neither
    input is modified."""
    merged = json.loads(json.dumps(base))
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_params(merged[key], value)
        else:
            merged[key] = json.loads(json.dumps(value))
    return merged


def load_params(path: str | Path, _chain: tuple[tuple[Path, str], ...] = ()) -> dict[str, Any]:
    """The params mapping of ``path`` with its ``base:`` chain resolved (not validated).

    A file may name one other params file as ``base: other.yaml``, resolved relative
    to the including file's folder; the including file's keys are deep-merged over
    the base's (:func:`merge_params`), and a base may have a base of its own. The
    result has no ``base`` key. Raises :class:`ConfigError` on an unreadable file, a
    top level that is not a mapping, a ``base`` that is not a string, or a cycle
    (the message names the chain, ``a.yaml -> b.yaml -> a.yaml``).
    """
    path = Path(path)
    key = path.resolve()
    seen = [resolved for resolved, _ in _chain]
    if key in seen:
        names = [shown for _, shown in _chain[seen.index(key):]] + [str(path)]
        raise ConfigError(f"{path}: base: cycle {' -> '.join(names)}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"{path}: base: must be the path of another params file, got {base!r}")
    return merge_params(load_params(path.parent / base, (*_chain, (key, str(path)))), data)


def load_config(
    path: str | Path, overrides: dict[str, Any] | list[str] | None = None
) -> RunConfig:
    """Load ``path`` (YAML, with its ``base:`` chain, :func:`load_params`), apply
    overrides, validate. Raises :class:`ConfigError`."""
    return build_config(load_params(path), overrides, source=str(path))


def _parent(data: dict[str, Any], key: str) -> tuple[dict[str, Any] | None, str]:
    """The mapping that holds dotted ``key``'s last part, and that part; ``None`` when a
    section on the way is missing or not a mapping."""
    *section, name = key.split(".")
    node: Any = data
    for part in section:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), name


def upgrade_run_config(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of a run's config mapping with the :data:`RETIRED_KEYS` read as their current
    keys, without the :data:`UNUSED_KEYS` (``analysis.annotator`` may be ``None``) and with
    the :data:`RENAMED_STAGES` renamed; a current mapping comes back equal."""
    data = json.loads(json.dumps(data))
    for old, retired in RETIRED_KEYS.items():
        node, name = _parent(data, old)
        if node is not None and name in node:  # written before the key was retired
            for key, value in retired.read(node.pop(name)).items():
                _set_dotted(data, key, value)
    if isinstance(data.get("stages"), list):
        data["stages"] = [RENAMED_STAGES.get(name, name) for name in data["stages"]]
    for key in UNUSED_KEYS:
        node, name = _parent(data, key)
        if node is not None:
            node.pop(name, None)
    return data


def saved_run_config(data: dict[str, Any]) -> dict[str, Any]:
    """A run's saved ``config.yaml`` mapping (every key it had, written whole) as today's
    keys: :func:`upgrade_run_config`, then the :data:`ADDED_KEYS` it lacks at the values
    it ran with; a current mapping comes back equal."""
    data = upgrade_run_config(data)
    for key, value in ADDED_KEYS.items():
        node, name = _parent(data, key)
        if node is not None:
            node.setdefault(name, value)
    return data


def load_run_config(
    path: str | Path, overrides: dict[str, Any] | list[str] | None = None
) -> RunConfig:
    """A run folder's saved ``config.yaml``, read as :func:`load_config` reads a params
    file but through :func:`saved_run_config`: keys added since at the values it ran
    with (:data:`ADDED_KEYS`), retired keys as the keys that replaced
    them (:data:`RETIRED_KEYS`), old stage names as their new ones
    (:data:`RENAMED_STAGES`), and without the :data:`UNUSED_KEYS`: versions before the
    judge and the strategy annotator got configs of their own wrote
    ``evaluation.judge.initial_emotion`` (and, with an annotator, its ``difficulty``,
    ``initial_emotion`` and appraisal settings) into every run's config; they never had
    an effect, so the run reads as it ran. Raises :class:`ConfigError` (a folder older
    than the table's cut-off: the key it does not know)."""
    return build_config(saved_run_config(load_params(path)), overrides, source=str(path))


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML (what every run saves as ``config.yaml``)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
