"""The benchmark's judge: a simulated user configured on its own (``evaluation.judge``),
never the training simulator.  :class:`Judge` is built once from that config
(:meth:`Judge.from_config`) and holds its seed, the simulator it runs, what its server
says it serves, its description (config, prompt and schema hashes, the served model)
and its name; comparisons refuse mixed judges (:func:`check_same_judge`,
:class:`JudgeMismatchError`).  The module keeps no state: each judge holds its own.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from importlib import resources
from pathlib import Path
from types import TracebackType
from typing import Any, Sequence

from rlver_lib.appraisal import appraisal_mode, structured_schemas
from rlver_lib.backends import close_backend
from rlver_lib.config import EvaluationConfig, JudgeConfig
from rlver_lib.models import build_simulator
from rlver_lib.user_prompts import prompt_files


class JudgeMismatchError(ValueError):
    """Benchmarks that were scored by different judges or protocols cannot be compared."""


# --------------------------------------------------------------------------- judge


#: Judge settings that do not change what the judge answers (how often it retries, how
#: long it waits, how many dialogues it serves at once, where its API key lives) and the
#: seed (recorded as the seed it samples with).  Every other field of a judge config
#: (:class:`~rlver_lib.config.JudgeConfig`) is part of its identity.
_JUDGE_OPERATIONAL = frozenset({"max_retries", "timeout_s", "concurrency", "n_threads", "api_key_env", "seed"})
#: How a judge reads first in reports and summaries; the other fields follow sorted.
_JUDGE_FIRST = ("backend", "model", "base_url", "difficulty", "appraisal", "temperature", "top_p", "top_k",
                "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "max_new_tokens",
                "n_ctx", "appraisal_chars", "message_chars")
#: Per served model, the fields of ``GET /v1/models`` that identify it (``created`` and
#: ``permission`` change from call to call and are left out).
_SERVED_MODEL_FIELDS = ("id", "owned_by", "root", "parent", "max_model_len", "meta")
#: At most this many models are recorded when the judge's alias is not among them (a
#: hosted API lists all of its models); ``models_total`` then says how many there were.
_MAX_LISTED_MODELS = 20
#: Of ``default_generation_settings`` in llama.cpp's ``GET /props``, per-slot state that
#: changes from call to call.
_VOLATILE_SLOT_FIELDS = frozenset({"id", "id_slot", "id_task", "is_processing", "next_token", "prompt",
                                   "tokens", "n_past", "n_decoded", "t_start"})


def _prompt_fingerprint(files: Sequence[str]) -> str:
    """SHA-256 over prompt files (names in ``rlver_lib/prompts``): each enters as its name,
    a NUL byte, its bytes and a NUL byte, in name order."""
    folder = resources.files("rlver_lib").joinpath("prompts")
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + folder.joinpath(name).read_bytes() + b"\0")
    return digest.hexdigest()


def _schema_fingerprint(schemas: dict[str, Any]) -> str:
    """SHA-256 of ``schemas`` as canonical JSON (sorted keys, no spaces, UTF-8)."""
    text = json.dumps(schemas, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _get_json(client: Any, url: str) -> tuple[Any, str | None]:
    """``(body, None)`` for an HTTP 200 JSON answer, else ``(None, why)`` (a short,
    stable reason: ``HTTP 404``, ``not JSON``, the exception's class name)."""
    import httpx

    try:
        response = client.get(url)
    except httpx.HTTPError as err:
        return None, type(err).__name__
    if response.status_code != 200:
        return None, f"HTTP {response.status_code}"
    try:
        return response.json(), None
    except ValueError:
        return None, "not JSON"


def served_model_identity(base_url: str, timeout_s: float = 10.0, *, model: str | None = None,
                          api_key: str | None = None) -> dict[str, Any]:
    """What an OpenAI-compatible server says it serves: ``GET /v1/models`` and, on
    llama.cpp's ``llama-server``, ``GET /props``.

    ``base_url``: the server root or its ``/v1`` root; ``timeout_s`` per request;
    ``model``: the alias the judge asks for; ``api_key``: sent as a bearer token.
    Returns a dict with, when the server answered:

    - ``models``: per listed model (only ``model`` when it is listed, else the first
      :data:`_MAX_LISTED_MODELS`, with ``models_total`` when there were more), its
      ``id``, ``owned_by``, ``root`` and ``parent`` (vLLM: the weights behind a
      ``--served-model-name``), ``max_model_len`` and ``meta`` (llama.cpp: parameter
      count, file size, vocabulary, training context), where given;
      ``model_listed``: whether ``model`` is among them (with ``model`` only);
    - ``props``: ``model_path``, ``model_alias``, ``model_ftype`` (quantisation),
      ``build_info``, ``chat_template_sha256`` and ``default_generation_settings`` (the
      server's own sampling defaults, which a judge overrides by sending every setting;
      per-slot state left out), where given;

    and ``models_error`` / ``props_error`` (``HTTP 404``, ``ConnectError``, ...) for
    what it did not answer.  Never raises for an HTTP or connection failure.
    """
    import httpx

    root = base_url.rstrip("/")
    root = root[: -len("/v1")] if root.endswith("/v1") else root
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out: dict[str, Any] = {}
    with httpx.Client(timeout=httpx.Timeout(timeout_s), headers=headers) as client:
        listing, why = _get_json(client, f"{root}/v1/models")
        data = listing.get("data") if isinstance(listing, dict) else None
        if isinstance(data, list):
            entries = [{k: e[k] for k in _SERVED_MODEL_FIELDS if k in e} for e in data if isinstance(e, dict)]
            matched = [e for e in entries if model is not None and e.get("id") == model]
            out["models"] = matched or entries[:_MAX_LISTED_MODELS]
            if not matched and len(entries) > _MAX_LISTED_MODELS:
                out["models_total"] = len(entries)
            if model is not None:
                out["model_listed"] = bool(matched)
        else:
            out["models_error"] = why or "no model list"
        props, why = _get_json(client, f"{root}/props")
        if isinstance(props, dict):
            kept: dict[str, Any] = {k: props[k] for k in ("model_path", "model_alias", "model_ftype", "build_info")
                                    if k in props}
            if isinstance(props.get("chat_template"), str):
                kept["chat_template_sha256"] = hashlib.sha256(props["chat_template"].encode("utf-8")).hexdigest()
            settings = props.get("default_generation_settings")
            if isinstance(settings, dict):
                kept["default_generation_settings"] = {k: v for k, v in settings.items()
                                                       if k not in _VOLATILE_SLOT_FIELDS}
            out["props"] = kept
        else:
            out["props_error"] = why or "not an object"
    return out


def _served_base_url(backend: Any) -> str | None:
    """The HTTP root of a judge's backend: a ``llama-server`` it started (``port``), an
    OpenAI-compatible client (``root``, else ``url`` less its path); ``None`` otherwise."""
    port = getattr(backend, "port", None)
    if isinstance(port, int):
        return f"http://127.0.0.1:{port}"
    root = getattr(backend, "root", None)
    if isinstance(root, str):
        return root
    url = getattr(backend, "url", None)
    if isinstance(url, str) and url.endswith("/chat/completions"):
        return url[: -len("/chat/completions")]
    return None


def _served_name(served: dict[str, Any] | None) -> str | None:
    """The weights behind a served alias, as its server named them: vLLM's ``root``
    when it differs from the alias, else the file of llama.cpp's ``model_path``."""
    if not served:
        return None
    for entry in served.get("models") or []:
        if entry.get("root") and entry.get("root") != entry.get("id"):
            return str(entry["root"])
    path = (served.get("props") or {}).get("model_path")
    return Path(str(path)).name if path else None


class Judge:
    """The benchmark's judge (``evaluation.judge``, never ``cfg.simulator``), built once
    from its config by :meth:`from_config`; the benchmark, the report and ``rlver eval``
    ask it.

    ``config``: an ``evaluation.judge`` section (or any simulator config); ``seed``: the
    seed the judge samples with.  It holds its :attr:`simulator` (built on first use),
    :attr:`served` (what its server says it serves), its :attr:`description` and its
    :attr:`name`.  Close it after use (:meth:`close`, or a ``with`` block): that closes
    its simulator's backend, a server it started or an HTTP client.
    """

    def __init__(self, config: JudgeConfig, seed: int) -> None:
        self.config = config
        self.seed = int(seed)
        #: What the judge's server answered (:func:`served_model_identity`): ``None``
        #: before :attr:`simulator` is built and for a judge that is not behind HTTP.
        self.served: dict[str, Any] | None = None
        self._simulator: Any = None

    @classmethod
    def from_config(cls, eval_cfg: EvaluationConfig, run_seed: int) -> Judge:
        """The judge of an ``evaluation`` section: ``eval_cfg.judge``, seeded with
        ``evaluation.judge.seed``, else the run's seed ``run_seed``."""
        seed = eval_cfg.judge.seed
        return cls(eval_cfg.judge, run_seed if seed is None else seed)

    def __enter__(self) -> Judge:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @property
    def simulator(self) -> Any:
        """The simulated user that judges, built on first use from :attr:`config` by
        ``models.build_simulator`` (as the training simulator is) with :attr:`seed`.

        A judge behind an HTTP server (``openai``, ``llamacpp``) asks it then, once, what
        it serves (:func:`served_model_identity`, API key from ``api_key_env``) and keeps
        the answer as :attr:`served`, which :attr:`description` records.
        """
        if self._simulator is None:
            cfg = self.config
            simulator = build_simulator(cfg, self.seed)
            backend = getattr(simulator, "backend", None)
            url = _served_base_url(backend) if cfg.backend in ("openai", "llamacpp") else None
            if url is not None:
                api_key = os.environ.get(cfg.api_key_env) if cfg.backend == "openai" else None
                alias = getattr(backend, "model", None) or getattr(getattr(backend, "client", None), "model", None)
                self.served = served_model_identity(url, min(float(cfg.timeout_s), 30.0), model=alias,
                                                    api_key=api_key)
            self._simulator = simulator
        return self._simulator

    def close(self) -> None:
        """Close the backend of its simulator, when one was built; :attr:`served`, the
        description and the name stay (a later :attr:`simulator` builds a new one)."""
        if self._simulator is not None:
            close_backend(self._simulator)
            self._simulator = None

    @property
    def description(self) -> dict[str, Any]:
        """What identifies the judge, as recorded in ``summary.json`` and compared by
        :func:`check_same_judge`.

        The rule backend is described by its change function alone.  An LLM judge by
        every config field that shapes its answers (all but :data:`_JUDGE_OPERATIONAL`):
        backend, model, base URL, difficulty, appraisal mode, every sampling setting
        (temperature, ``top_p``, ``top_k``, ``min_p``, the repetition, presence and
        frequency penalties), token budget, ``n_ctx``, the field caps, the ``expected_*``
        settings of an ``expected`` appraisal (with the code's
        ``expected_difficulty_shift`` and ``expected_top_logprobs``); plus ``seed``,
        ``prompt_files`` and ``prompts_sha256`` (the prompt files it reads, so an edited
        prompt is a different judge), ``schemas_sha256`` (the JSON schemas built in
        code) and ``served``: :attr:`served`, absent when nothing was asked.
        """
        judge_cfg = self.config
        if judge_cfg.backend == "rule":
            return {"backend": "rule", "change_function": "default_change_fn"}
        mode = appraisal_mode(judge_cfg.appraisal)
        kept = {k: v for k, v in judge_cfg.model_dump().items()
                if k not in _JUDGE_OPERATIONAL and mode.keeps_field(k)}
        described = {k: kept.pop(k) for k in _JUDGE_FIRST if k in kept}
        described.update(sorted(kept.items()))
        described.update(mode.identity_constants(judge_cfg))  # the code's constants of its mode
        files = prompt_files(judge_cfg)
        described.update(seed=self.seed, prompt_files=files, prompts_sha256=_prompt_fingerprint(files),
                         schemas_sha256=_schema_fingerprint(structured_schemas(judge_cfg)))
        if self.served is not None:
            described["served"] = copy.deepcopy(self.served)
        return described

    @property
    def name(self) -> str:
        """The judge's one-line name for reports and ``rlver eval``: :meth:`name_of` its
        :attr:`description`."""
        return self.name_of(self.description)

    @staticmethod
    def name_of(description: dict[str, Any]) -> str:
        """The one-line name of a judge's :attr:`description`, also of one recorded in a
        ``summary.json`` (the model, what its server serves, backend, URL, difficulty,
        appraisal, sampling settings and seed)."""
        judge = description
        if judge.get("backend") == "rule":
            return "the rule simulator (no language model)"
        where = f" at {judge['base_url']}" if judge.get("base_url") else ""
        behind = _served_name(judge.get("served"))
        serving = f" (serving `{behind}`)" if behind else ""
        if judge.get("served", {}).get("model_listed") is False:
            serving += " (not listed by its server)"
        sampling = ", ".join(f"{k} {judge[k]}" for k in ("top_p", "top_k", "min_p", "repetition_penalty",
                                                         "presence_penalty", "frequency_penalty") if k in judge)
        appraisal = f", {judge['appraisal']} appraisal" if judge.get("appraisal") else ""
        return (f"`{judge.get('model')}`{serving} through `{judge.get('backend')}`{where}, {judge.get('difficulty')} "
                f"difficulty{appraisal}, temperature {judge.get('temperature')}"
                + (f", {sampling}" if sampling else "") + f", seed {judge.get('seed')}")


def _comparison_key(summary: dict[str, Any]) -> tuple[str, str]:
    judge = summary.get("judge")
    protocol = summary.get("protocol")
    return (json.dumps(judge, sort_keys=True), json.dumps(protocol, sort_keys=True))


def _dotted(value: Any, prefix: str) -> dict[str, Any]:
    """A nested mapping as ``{dotted.key: leaf}`` (lists are leaves)."""
    if not isinstance(value, dict) or not value:
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, item in value.items():
        out.update(_dotted(item, f"{prefix}.{key}"))
    return out


def check_same_judge(summaries: dict[str, dict[str, Any]]) -> None:
    """Refuse to compare benchmarks scored differently.

    ``summaries`` maps a name (a run or cell) to its ``summary.json`` content.  Raises
    :class:`JudgeMismatchError` naming the runs and the differing judge or protocol
    fields (nested ones dotted, e.g. ``judge.served.props.model_path``) when they were
    not all scored by the same judge under the same protocol (every recorded field of
    :attr:`Judge.description` counts: sampling settings, caps, prompts, schemas and
    the model its server said it serves), or when a summary does not record its judge
    (written before judges were recorded).
    """
    missing = [name for name, s in summaries.items() if "judge" not in s or "protocol" not in s]
    if missing:
        raise JudgeMismatchError(f"cannot compare: no judge and protocol recorded for {', '.join(missing)} "
                                 "(evaluated before judges were recorded); re-run its evaluation")
    groups: dict[tuple[str, str], list[str]] = {}
    for name, s in summaries.items():
        groups.setdefault(_comparison_key(s), []).append(name)
    if len(groups) <= 1:
        return
    items = list(summaries.items())
    ref_name, ref = items[0]
    lines = []
    for name, s in items[1:]:
        for part in ("judge", "protocol"):
            a, b = _dotted(ref.get(part) or {}, part), _dotted(s.get(part) or {}, part)
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    lines.append(f"{key}: {ref_name}={a.get(key)!r} vs {name}={b.get(key)!r}")
    raise JudgeMismatchError("cannot compare runs judged differently (a score depends on its judge and protocol; "
                             "set one evaluation.judge and evaluation.protocol for all of them):\n  "
                             + "\n  ".join(dict.fromkeys(lines)))
