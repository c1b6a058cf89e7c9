"""The strategy taxonomy of RLVER §5 and its annotator: an LLM (or the rule annotator)
labels each reply's primary strategy, strategy moves and dimensions
(:func:`annotate_strategies`); the mix over training; the annotator's reliability
(:func:`self_agreement`, :func:`annotator_validation` against the shipped labelled set).
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from rlver_lib.backends import ChatBackend, Generation, closing_backend, structured_batch
from rlver_lib.config import AnnotatorConfig, RunConfig, SamplingParams
from rlver_lib.files import iter_jsonl
from rlver_lib.models import make_simulator_backend
from rlver_lib.plots import level_colours, new_figure
from rlver_lib.stats import cohen_kappa

# --------------------------------------------------------------------------- strategy taxonomy


@dataclass(frozen=True)
class Category:
    """One label of the strategy taxonomy: ``key``, readable ``name``, ``definition``
    (what the annotator looks for) and an ``example`` reply that shows it."""

    key: str
    name: str
    definition: str
    example: str


#: The paper's five response dimensions (RLVER §5, "strategy evolution": thinking
#: models gain in empathic depth and core insight, non-thinking ones in solution
#: crafting).  Each is rated 0 (absent), 1 (present but generic or partial) or 2
#: (clear and specific to this user).
DIMENSIONS: tuple[Category, ...] = (
    Category("empathic_depth", "empathic depth",
             "Names the user's specific feelings and what caused them and accepts them, beyond a "
             "generic 'that's tough'.",
             "You were made to look careless in front of the team by the one person whose respect "
             "you wanted. No wonder it keeps replaying in your head."),
    Category("core_insight", "core insight",
             "Points at what lies under the surface: the real need, conflict or pattern behind what "
             "the user says.",
             "It sounds less about the money than about feeling that your brother never takes you "
             "seriously."),
    Category("solution_crafting", "solution crafting",
             "Offers concrete, feasible steps fitted to this user's situation, not generic tips.",
             "Before Friday, list the three clients who pay late and send each a dated reminder; "
             "that alone covers next month's rent."),
    Category("style_adaptability", "style adaptability",
             "Fits tone, length and register to this user: brief with a terse user, gentle with a "
             "fragile one, no lecture, no template.",
             "(to a curt 'whatever') Fair enough. Want to just vent for a minute?"),
    Category("dialogue_guidance", "dialogue guidance",
             "Steers the conversation forward on purpose: an open question, a next topic, an "
             "invitation to reflect.",
             "What would a good outcome of tomorrow's talk look like for you?"),
)

#: The strategy mix: which conversational moves a reply makes (several may apply).
STRATEGIES: tuple[Category, ...] = (
    Category("validation", "validation",
             "Says the user's feeling or view is understandable or legitimate.",
             "Anyone would be angry after being passed over like that."),
    Category("reflective_listening", "reflective listening",
             "Restates or paraphrases what the user said or feels, in its own words.",
             "So you did all the preparation and someone else presented it as theirs."),
    Category("praise", "praise",
             "Praises something the user did or is.",
             "Calling the landlord the same day was exactly the right move."),
    Category("advice", "advice",
             "Suggests what the user could do, or analyses the options.",
             "You could ask HR for the written promotion criteria first."),
    Category("question", "question",
             "Asks the user something, to learn more or to prompt reflection.",
             "What did she say when you told her?"),
    Category("reassurance", "reassurance",
             "Comforts: it will be fine, they are not alone, no need to worry.",
             "You'll get through this, and you're not alone in it."),
    Category("self_disclosure", "self-disclosure",
             "Shares its own (claimed) experience or feelings.",
             "I've been in a similar spot with a landlord once."),
)
OTHER = Category("other", "other",
                 "None of the above is the main move: off-topic, generic filler, a refusal, or text "
                 "that is not a reply to the user.",
                 "As an AI language model, I cannot have opinions.")
ABSOLVES = Category("absolves_user", "absolves the user",
                    "Says or implies that the user was not at fault, did nothing wrong, or that the "
                    "blame lies with others.",
                    "None of this is your fault; the other driver should have been more careful.")

STRATEGY_KEYS = tuple(c.key for c in STRATEGIES)
DIMENSION_KEYS = tuple(c.key for c in DIMENSIONS)
PRIMARY_KEYS = (*STRATEGY_KEYS, OTHER.key)
TAXONOMY: dict[str, tuple[Category, ...]] = {
    "dimensions": DIMENSIONS, "strategies": STRATEGIES, "primary": (*STRATEGIES, OTHER), "flags": (ABSOLVES,)}
UNPARSED = "unparsed"
ANNOTATION_FIELDS = ("primary", *STRATEGY_KEYS, *DIMENSION_KEYS, ABSOLVES.key)


def taxonomy_table() -> pd.DataFrame:
    """The taxonomy as a table (``group, key, name, definition, example``), for reports."""
    rows = [{"group": group, "key": c.key, "name": c.name, "definition": c.definition, "example": c.example}
            for group, cats in (("dimension (0-2)", DIMENSIONS), ("strategy", STRATEGIES),
                                ("primary only", (OTHER,)), ("flag", (ABSOLVES,)))
            for c in cats]
    return pd.DataFrame(rows)


def annotation_schema() -> dict[str, Any]:
    """JSON schema of one annotation: ``primary`` (one of :data:`PRIMARY_KEYS`), a
    boolean per strategy, an integer 0-2 per dimension, and ``absolves_user``."""
    props: dict[str, Any] = {"primary": {"type": "string", "enum": list(PRIMARY_KEYS)}}
    props.update({k: {"type": "boolean"} for k in STRATEGY_KEYS})
    props.update({k: {"type": "integer", "enum": [0, 1, 2]} for k in DIMENSION_KEYS})
    props[ABSOLVES.key] = {"type": "boolean"}
    return {"type": "object", "properties": props, "required": list(ANNOTATION_FIELDS), "additionalProperties": False}


def _describe(cats: Sequence[Category]) -> str:
    return "\n".join(f'- {c.key}: {c.definition} Example: "{c.example}"' for c in cats)


ANNOTATION_INSTRUCTIONS = (
    "You annotate one reply of an emotional-support chat assistant. Judge only the reply, in the "
    "context of the user's last message.\n\n"
    "Strategies (true if the reply makes this move at all, several may be true):\n{strategies}\n\n"
    "primary: the single strategy that dominates the reply, or \"other\":\n- other: {other}\n\n"
    "Dimensions, each 0 (absent), 1 (present but generic or partial) or 2 (clear and specific to "
    "this user):\n{dimensions}\n\n"
    "{absolves_key}: {absolves} Example: \"{absolves_example}\"\n\n"
    "Answer with one JSON object with exactly these keys: {keys}."
)


def annotation_conversation(reply: str, user_message: str | None = None) -> list[dict[str, str]]:
    """The chat messages asking the annotator for one reply's annotation
    (:func:`annotation_schema`): the taxonomy with definitions and examples as the
    system message, the user's message and the reply as the user message."""
    system = ANNOTATION_INSTRUCTIONS.format(
        strategies=_describe(STRATEGIES), other=OTHER.definition, dimensions=_describe(DIMENSIONS),
        absolves_key=ABSOLVES.key, absolves=ABSOLVES.definition, absolves_example=ABSOLVES.example,
        keys=", ".join(ANNOTATION_FIELDS))
    body = (f"User said:\n{user_message}\n\n" if user_message else "") + f"Reply:\n{reply}"
    return [{"role": "system", "content": system}, {"role": "user", "content": body}]


def parse_annotation(text: str) -> dict[str, Any] | None:
    """The annotation in an annotator's output, validated against :func:`annotation_schema`
    (every key, right types and values), or ``None`` when it is not valid."""
    try:
        obj = json.loads(text.strip().removeprefix("```json").removesuffix("```"), strict=False)
    except (json.JSONDecodeError, AttributeError):
        return None
    if not isinstance(obj, dict) or obj.get("primary") not in PRIMARY_KEYS:
        return None
    for key in (*STRATEGY_KEYS, ABSOLVES.key):
        if not isinstance(obj.get(key), bool):
            return None
    for key in DIMENSION_KEYS:
        value = obj.get(key)
        if isinstance(value, bool) or value not in (0, 1, 2):
            return None
    return {key: obj[key] for key in ANNOTATION_FIELDS}


def annotate_strategies(
    annotator: ChatBackend,
    replies: Sequence[str],
    *,
    user_messages: Sequence[str | None] | None = None,
    seed: int = 0,
    temperature: float = 0.0,
    max_new_tokens: int = 200,
    max_retries: int = 2,
    batch_size: int = 16,
) -> pd.DataFrame:
    """Annotations of ``replies`` by an LLM annotator, JSON-schema constrained, sent in
    batches of ``batch_size`` conversations.

    Returns one row per reply (same order) with the :data:`ANNOTATION_FIELDS` columns and
    ``parsed`` (bool).  Outputs that do not parse (:func:`parse_annotation`) are asked
    again, at most ``max_retries`` times (seed ``seed + attempt``); what still fails
    has ``primary`` = :data:`UNPARSED` and missing values elsewhere.
    Raises ``ValueError`` when ``user_messages`` and ``replies`` differ in length.
    """
    contexts = list(user_messages) if user_messages is not None else [None] * len(replies)
    if len(contexts) != len(replies):
        raise ValueError("annotate_strategies: user_messages and replies differ in length")
    results, _ = structured_batch(
        annotator, list(zip(replies, contexts)), annotation_schema(), lambda text, _: parse_annotation(text),
        SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed), max_retries=max_retries,
        render=lambda item: annotation_conversation(*item), batch_size=batch_size)
    rows = [{**(r.value or {"primary": UNPARSED}), "parsed": r.value is not None} for r in results]
    return pd.DataFrame(rows, columns=[*ANNOTATION_FIELDS, "parsed"])


# --------------------------------------------------------------------------- the rule annotator

_CUES: dict[str, re.Pattern[str]] = {
    "validation": re.compile(r"\b(?:understandable|makes (?:total |complete )?sense|(?:it'?s|it is) (?:okay|ok|normal|"
                             r"natural|valid) to|anyone would|of course you|your feelings? (?:is|are) valid|"
                             r"no wonder)\b|可以理解|很正常", re.I),
    "reflective_listening": re.compile(r"\b(?:it sounds like|sounds like|it seems (?:like )?you|you(?:'re| are) "
                                       r"feeling|you feel|what i(?:'m| am) hearing|so you)\b|听起来|你觉得", re.I),
    "praise": re.compile(r"\b(?:proud of you|well done|great job|good job|impressive|brave|admire|"
                         r"you did (?:great|well|the right thing)|that takes courage)\b|真棒|了不起|做得好", re.I),
    "advice": re.compile(r"\b(?:you (?:should|could|might|can) (?:try|consider|talk|ask|write|take|make)|try to|"
                         r"consider|i (?:suggest|recommend)|how about|it (?:might|may|could) help|"
                         r"one (?:option|idea|step))\b|建议|可以试试", re.I),
    "question": re.compile(r"[?？]"),
    "reassurance": re.compile(r"\b(?:it(?:'ll| will) be (?:okay|ok|fine|alright)|don'?t worry|you(?:'re| are) not "
                              r"alone|everything will|(?:it'?s|it is) going to be|things will get better)\b|别担心|"
                              r"会好的", re.I),
    "self_disclosure": re.compile(r"\b(?:i(?:'ve| have) been (?:there|through)|when i was|me too|i remember|"
                                  r"i also (?:felt|had)|in my (?:own )?experience)\b|我也曾|我以前", re.I),
}
_ABSOLVE_CUES = re.compile(r"\b(?:not your fault|you did nothing wrong|you didn'?t do anything wrong|not to blame|"
                           r"(?:weren'?t|are not|aren'?t) to blame|you were right|they should have)\b|不是你的错|"
                           r"你没有错", re.I)
_INSIGHT_CUES = re.compile(r"\b(?:because|underneath|really about|the real|what matters|deep down)\b|其实|真正", re.I)


def rule_annotation(reply: str) -> dict[str, Any]:
    """The deterministic lexical annotation of :class:`RuleAnnotator`.

    Each strategy is true when one of its cue patterns occurs (``question``: a
    question mark); ``primary`` is the strategy with the most cue matches (ties
    broken by :data:`STRATEGY_KEYS` order), ``other`` when none matches;
    ``empathic_depth`` = min(2, validation + reflective listening);
    ``solution_crafting`` = advice (0/1) + 1 when the reply also exceeds 200
    characters; ``dialogue_guidance`` = question (0/1) + 1 when it also gives advice;
    ``core_insight`` = 1 when an insight cue ("because", "really about", ...) occurs;
    ``style_adaptability`` = 0 (not rated lexically); ``absolves_user`` from phrases
    such as "not your fault".  Plumbing and tests only: it does not read meaning.
    """
    counts = {key: len(pattern.findall(reply)) for key, pattern in _CUES.items()}
    present = {key: counts[key] > 0 for key in STRATEGY_KEYS}
    best = max(STRATEGY_KEYS, key=lambda k: (counts[k], -STRATEGY_KEYS.index(k)))
    return {
        "primary": best if counts[best] else OTHER.key,
        **present,
        "empathic_depth": min(2, int(present["validation"]) + int(present["reflective_listening"])),
        "core_insight": int(bool(_INSIGHT_CUES.search(reply))),
        "solution_crafting": int(present["advice"]) + int(present["advice"] and len(reply) > 200),
        "style_adaptability": 0,
        "dialogue_guidance": int(present["question"]) + int(present["question"] and present["advice"]),
        ABSOLVES.key: bool(_ABSOLVE_CUES.search(reply)),
    }


class RuleAnnotator:
    """A :class:`~rlver_lib.backends.ChatBackend` that answers an annotation conversation
    (:func:`annotation_conversation`) with :func:`rule_annotation` of its reply, as JSON.

    What ``analysis.annotator.backend: rule`` builds; it needs no model, ignores sampling
    and seeds (so its self-agreement is 1 by construction) and is for plumbing and
    tests only."""

    def generate(self, conversations, sampling, json_schema=None):
        out = []
        for conv in conversations:
            reply = conv[-1]["content"].split("Reply:\n", 1)[-1]
            out.append(Generation(text=json.dumps(rule_annotation(reply))))
        return out


def annotator_config(cfg: RunConfig) -> AnnotatorConfig:
    """The strategy annotator's config: the benchmark judge's model (``cfg.evaluation.judge``:
    its backend, model, URL, key variable, timeout, threads, context and retries) with the
    annotator's defaults (greedy; one slot and n-gram speculation, or the judge's
    ``concurrency`` for a judge that is not a llamacpp server on these cores), and over
    them the fields that ``cfg.analysis.annotator`` sets. An annotator section that names
    another backend than the judge's takes nothing from the judge."""
    own = cfg.analysis.annotator
    source = cfg.evaluation.judge
    given = own.model_dump(include=own.model_fields_set) if own is not None else {}
    if given.get("backend", source.backend) != source.backend:
        return own
    keep = {"backend", "model", "base_url", "api_key_env", "timeout_s", "n_threads", "n_ctx", "max_retries"}
    if source.backend != "llamacpp":
        keep.add("concurrency")
    return AnnotatorConfig(**{k: v for k, v in source.model_dump().items() if k in keep} | given)


@contextmanager
def open_annotator(annotator_cfg: AnnotatorConfig, seed: int) -> Iterator[ChatBackend]:
    """The strategy annotator for the length of a ``with`` block: :class:`RuleAnnotator`
    for backend ``rule``, else ``models.make_simulator_backend`` (the simulator's
    backend kinds; a server it starts is stopped on the way out)."""
    annotator = RuleAnnotator() if annotator_cfg.backend == "rule" else make_simulator_backend(annotator_cfg, seed)
    with closing_backend(annotator):
        yield annotator


def annotator_name(annotator_cfg: AnnotatorConfig) -> str:
    """``backend:model`` of a strategy annotator, for tables and reports."""
    return ("rule (lexical cues, no model)" if annotator_cfg.backend == "rule"
            else f"{annotator_cfg.backend}:{annotator_cfg.model}")


# --------------------------------------------------------------------------- strategy mix


def strategy_mix(annotated: pd.DataFrame, by: str = "step", column: str = "primary") -> pd.DataFrame:
    """Share of each ``label`` value (primary strategy) per ``by`` level, long form:
    ``by, strategy, share``; shares of a level sum to 1, strategies absent at a level get
    share 0.  Unparsed annotations are left out."""
    data = annotated[annotated[column] != UNPARSED]
    shares = pd.crosstab(data[by], data[column], normalize="index")
    return shares.reset_index().melt(id_vars=by, var_name="strategy", value_name="share")


def strategy_use(annotated: pd.DataFrame, by: str = "source") -> pd.DataFrame:
    """Share of replies that make each strategy move (several per reply), and the mean
    of each dimension (0-2), per ``by`` level: long form ``by, measure, kind, value, n``
    with ``kind`` ``strategy`` or ``dimension``.  Unparsed annotations are left out."""
    data = annotated[annotated["primary"] != UNPARSED]
    rows = []
    for level, group in data.groupby(by, sort=False):
        for key in STRATEGY_KEYS:
            rows.append({by: level, "measure": key, "kind": "strategy",
                         "value": float(group[key].astype(float).mean()), "n": len(group)})
        for key in DIMENSION_KEYS:
            rows.append({by: level, "measure": key, "kind": "dimension",
                         "value": float(group[key].astype(float).mean()), "n": len(group)})
    return pd.DataFrame(rows, columns=[by, "measure", "kind", "value", "n"])


STRATEGY_COLOURS = level_colours(PRIMARY_KEYS)


def plot_strategy_mix(mix: pd.DataFrame, by: str = "step", *, order: Sequence[Any] | None = None) -> Figure:
    """Primary-strategy shares against ``by`` (output of :func:`strategy_mix`): stacked
    areas for a numeric ``by`` (training step), stacked bars otherwise (baseline vs
    trained, think vs non-think), in ``order`` when given.  Every strategy keeps its
    colour across figures (:data:`STRATEGY_COLOURS`)."""
    wide = mix.pivot(index=by, columns="strategy", values="share").fillna(0)
    wide = wide.reindex(columns=[k for k in PRIMARY_KEYS if k in wide.columns])
    wide = wide.reindex(order) if order is not None else wide.sort_index()
    colours = [STRATEGY_COLOURS[c] for c in wide.columns]
    fig, (ax,) = new_figure()
    if pd.api.types.is_numeric_dtype(wide.index) and order is None:
        ax.stackplot(wide.index, wide.T.to_numpy(), labels=list(wide.columns), colors=colours, alpha=0.85)
        ax.set(xlabel="training step" if by == "step" else by)
    else:
        bottom = np.zeros(len(wide))
        positions = np.arange(len(wide))
        for col, colour in zip(wide.columns, colours):
            ax.bar(positions, wide[col].to_numpy(), bottom=bottom, color=colour, label=col)
            bottom += wide[col].to_numpy()
        ax.set_xticks(positions, [str(v) for v in wide.index])
        ax.set(xlabel=by)
    ax.set(ylabel="share of replies", ylim=(0, 1))
    ax.legend(title="primary strategy", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def plot_strategy_use(use: pd.DataFrame, by: str = "source") -> Figure:
    """Two panels from :func:`strategy_use`: share of replies making each strategy move,
    and mean dimension ratings (0-2), bars grouped by measure, one colour per ``by``
    level (e.g. think vs non-think side by side)."""
    levels = list(dict.fromkeys(use[by].astype(str)))
    palette = level_colours(levels)
    fig, axes = new_figure(ncols=2, width=6.5)
    for ax, kind, ylabel, ylim in ((axes[0], "strategy", "share of replies", (0, 1)),
                                   (axes[1], "dimension", "mean rating (0-2)", (0, 2))):
        sub = use[use["kind"] == kind]
        measures = list(dict.fromkeys(sub["measure"]))
        width = 0.8 / max(1, len(levels))
        for j, level in enumerate(levels):
            vals = sub[sub[by].astype(str) == level].set_index("measure")["value"].reindex(measures)
            ax.bar(np.arange(len(measures)) + j * width, vals.to_numpy(), width, color=palette[level], label=level)
        ax.set_xticks(np.arange(len(measures)) + width * (len(levels) - 1) / 2, measures, rotation=40, ha="right")
        ax.set(ylabel=ylabel, ylim=ylim, title=kind)
        ax.legend(title=by)
    return fig


# --------------------------------------------------------------------------- annotator reliability


def agreement_table(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """Agreement of two annotation tables of the same replies (row i with row i), one row
    per field of :data:`ANNOTATION_FIELDS`: ``field, agreement`` (share equal), ``kappa``
    (:func:`rlver_lib.stats.cohen_kappa`), ``n``.  Rows unparsed in either table are left out."""
    ok = (a["primary"] != UNPARSED).to_numpy() & (b["primary"] != UNPARSED).to_numpy()
    rows = []
    for key in ANNOTATION_FIELDS:
        x, y = a[key].to_numpy()[ok], b[key].to_numpy()[ok]
        rows.append({"field": key, "agreement": float(np.mean(x.astype(str) == y.astype(str))) if ok.any() else np.nan,
                     "kappa": cohen_kappa(list(x), list(y)) if ok.any() else np.nan, "n": int(ok.sum())})
    return pd.DataFrame(rows)


def self_agreement(annotator: ChatBackend, replies: Sequence[str], user_messages: Sequence[str | None], *,
                   seeds: Sequence[int], temperature: float, max_new_tokens: int = 200) -> pd.DataFrame:
    """The annotator's agreement with itself: the same replies annotated once per seed at
    ``temperature``; :func:`agreement_table` of every pair of seeds, averaged per field
    (``field, agreement, kappa, n, pairs``).  Raises ``ValueError`` with fewer than two
    seeds or no replies."""
    if len(seeds) < 2 or not replies:
        raise ValueError("self_agreement needs at least two seeds and one reply")
    runs = [annotate_strategies(annotator, replies, user_messages=user_messages, seed=s, temperature=temperature,
                             max_new_tokens=max_new_tokens) for s in seeds]
    tables = [agreement_table(runs[i], runs[j]) for i in range(len(runs)) for j in range(i + 1, len(runs))]
    merged = pd.concat(tables).groupby("field", sort=False)[["agreement", "kappa", "n"]].mean().reset_index()
    return merged.assign(pairs=len(tables))


LABELLED_SET = "strategy_labels.jsonl"
#: The label passes of the shipped set (see ``strategy_labels_README.md``): ``p1``
#: annotator A, ``p2`` annotator A again (reshuffled, same session: a consistency
#: check), ``b1`` annotator B, working blind to ``p1`` / ``p2`` in a separate session.
LABEL_PASSES = ("p1", "p2", "b1")
#: The two independently made passes: their agreement is the set's inter-annotator kappa.
INDEPENDENT_PASSES = ("p1", "b1")
#: One annotator's two passes: their agreement measures consistency, not independence.
CONSISTENCY_PASSES = ("p1", "p2")


def load_labelled_set(path: str | Path | None = None) -> pd.DataFrame:
    """The shipped labelled set (``rlver_lib/data/strategy_labels.jsonl``, see
    ``strategy_labels_README.md`` there for who labelled it and how): one row per policy
    reply with ``id, scenario_id, turn, user, reply`` and, for each pass of
    :data:`LABEL_PASSES`, ``<pass>_primary``, one boolean column ``<pass>_<strategy>``
    per strategy and ``<pass>_absolves_user``.  Raises ``ValueError`` naming the line
    of an unknown label or a missing pass."""
    source = Path(path) if path else Path(str(resources.files("rlver_lib") / "data" / LABELLED_SET))
    rows = []
    for line, rec in iter_jsonl(source):
        row = {k: rec.get(k) for k in ("id", "scenario_id", "turn", "user", "reply")}
        for name in LABEL_PASSES:
            lab = rec.get(name)
            if not isinstance(lab, dict) or "primary" not in lab:
                raise ValueError(f"{source}:{line}: label pass {name!r} missing; every line needs {list(LABEL_PASSES)}")
            strategies = lab.get("strategies", [])
            bad = [s for s in [lab.get("primary"), *strategies] if s not in PRIMARY_KEYS]
            if bad:
                raise ValueError(f"{source}:{line}: {name}: unknown label(s) {bad}; known: {list(PRIMARY_KEYS)}")
            row[f"{name}_primary"] = lab["primary"]
            row.update({f"{name}_{k}": k in strategies for k in STRATEGY_KEYS})
            row[f"{name}_{ABSOLVES.key}"] = bool(lab.get(ABSOLVES.key, False))
        rows.append(row)
    return pd.DataFrame(rows)


def _pass_table(labelled: pd.DataFrame, name: str) -> pd.DataFrame:
    keys = ("primary", *STRATEGY_KEYS, ABSOLVES.key)
    return pd.DataFrame({k: labelled[f"{name}_{k}"].to_numpy() for k in keys})


def _agreement_on(a: pd.DataFrame, b: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    rows = []
    for key in keys:
        x, y = a[key].astype(str).to_numpy(), b[key].astype(str).to_numpy()
        rows.append({"field": key, "agreement": float(np.mean(x == y)), "kappa": cohen_kappa(list(x), list(y)),
                     "n": len(x)})
    return pd.DataFrame(rows)


def labelled_set_agreement(labelled: pd.DataFrame | None = None,
                           passes: tuple[str, str] = INDEPENDENT_PASSES) -> pd.DataFrame:
    """Agreement between two label passes of the shipped set, by default the two
    independent annotators (:data:`INDEPENDENT_PASSES`; :data:`CONSISTENCY_PASSES` for
    annotator A against itself): ``field, agreement, kappa, n`` for ``primary``, each
    strategy and ``absolves_user``."""
    labelled = load_labelled_set() if labelled is None else labelled
    keys = ("primary", *STRATEGY_KEYS, ABSOLVES.key)
    return _agreement_on(_pass_table(labelled, passes[0]), _pass_table(labelled, passes[1]), keys)


def annotator_validation(annotator: ChatBackend, labelled: pd.DataFrame | None = None, *, n: int | None = None,
                     seed: int = 0, max_new_tokens: int = 200) -> dict[str, Any]:
    """The annotator against the two independent label passes of the shipped set
    (:data:`INDEPENDENT_PASSES`, its first ``n`` items).

    Returns ``table`` (``field, agreement, kappa, n, reference`` for reference ``p1``
    (annotator A) and ``b1`` (annotator B); unparsed annotations count as
    disagreements), ``n``, ``n_unparsed`` and the per-item ``annotations``.  Raises
    ``ValueError`` when no item is selected.
    """
    labelled = load_labelled_set() if labelled is None else labelled
    labelled = labelled.head(n) if n is not None else labelled
    if labelled.empty:
        raise ValueError("annotator_validation needs at least one labelled item")
    annotated = annotate_strategies(annotator, list(labelled["reply"]), user_messages=list(labelled["user"]),
                                    seed=seed, max_new_tokens=max_new_tokens)
    keys = ("primary", *STRATEGY_KEYS, ABSOLVES.key)
    annotated_keys = annotated[list(keys)].copy()
    tables = [_agreement_on(_pass_table(labelled, ref), annotated_keys, keys).assign(reference=ref)
              for ref in INDEPENDENT_PASSES]
    return {"table": pd.concat(tables, ignore_index=True), "n": len(labelled),
            "n_unparsed": int((annotated["primary"] == UNPARSED).sum()),
            "annotations": pd.concat([labelled[["id", "reply", *(f"{p}_primary" for p in INDEPENDENT_PASSES)]]
                                      .reset_index(drop=True), annotated], axis=1)}
