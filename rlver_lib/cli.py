"""The ``rlver`` command line (docs/ARCHITECTURE.md "Code map"; README "Commands").

    rlver run PARAMS.yaml [--set key=value ...]      pipeline notebooks -> outputs/<run>/report.html
    rlver ablate GRID.yaml [--set key=value ...]     every grid cell, then one comparison report
    rlver eval PARAMS.yaml [--set key=value ...]     the benchmark alone (base model or policy.adapter)
    rlver seeds RUN_DIR [RUN_DIR ...] [--json OUT]   paired differences of several training seeds, pooled
    rlver sage-score FILE [FILE ...] [--json]        Sentient score of SAGE-format transcripts (and their protocol)
    rlver judge-agreement FILE [FILE ...] [options]  the benchmark judge against SAGE's stored judgements
    rlver scenarios validate FILE                    exit 0 when valid, else file/line/field named
    rlver models prepare                             convert and check the embedded models
    rlver doctor                                     CPU, native builds, threads, smoke generations

Exit status: 0 on success, 2 for a bad params file or override (the key named), 1 when a
pipeline stage fails (its cell's error printed) or another process writes the run folder,
130 on Ctrl-C and 143 on SIGTERM (both stop the run cleanly: the manifest says
``interrupted``, one line says how to resume). ``threads`` in the params, else the
environment, fixes ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` before any model library loads.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from rlver_lib.config import ConfigError, RunConfig
from rlver_lib.files import process_rank
from rlver_lib.params import load_config
from rlver_lib.pipeline.process import (
    PipelineError,
    RunInterrupted,
    Terminated,
    run_folder_lock,
    sigterm_as_interrupt,
    single_process_environment,
    threads_per_process,
)

_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def configure_threads(threads: int | None) -> None:
    """Set the BLAS/OpenMP thread variables; must run before torch is imported.

    An explicit ``threads`` wins, shared among the processes of a launch on this
    machine (:func:`~rlver_lib.pipeline.process.threads_per_process`); otherwise variables
    already set are kept and unset ones default to the number of CPUs this process may use.
    """
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for var in _THREAD_VARS:
        if threads:
            os.environ[var] = str(threads_per_process(threads))
        else:
            os.environ.setdefault(var, os.environ.get("OMP_NUM_THREADS", str(available or 1)))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _load(path: str, overrides: list[str]) -> RunConfig:
    cfg = load_config(path, overrides)
    configure_threads(cfg.threads)
    return cfg


def _cmd_run(args: argparse.Namespace) -> int:
    cfg = _load(args.params, args.set)
    from rlver_lib.pipeline.run import run_pipeline  # after configure_threads, as every model library

    report = run_pipeline(cfg, params_file=args.params, progress=not args.no_progress)
    print(f"report: {report}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    cfg = _load(args.params, args.set)
    # imported after configure_threads: these commands' modules may load torch
    from rlver_lib.evaluation.stage import eval_command

    if process_rank() > 0:  # only rank 0 writes eval/<label>/ (evaluate)
        return eval_command(cfg)
    # not beside an `rlver run` writing the same folder; as one process, not rank 0 of a
    # process group the other ranks never join (run.single_process_environment)
    with run_folder_lock(cfg.run_dir.resolve()), single_process_environment():
        return eval_command(cfg)


def _cmd_ablate(args: argparse.Namespace) -> int:
    from rlver_lib.pipeline.ablate import load_grid, run_ablation

    _, cells = load_grid(args.grid, args.set)  # validates every cell before anything runs
    configure_threads(cells[0].config.threads)
    report = run_ablation(args.grid, args.set, progress=not args.no_progress)
    print(f"report: {report}")
    return 0


def _cmd_seeds(args: argparse.Namespace) -> int:
    from rlver_lib.analysis.runs import pooled_over_seeds
    from rlver_lib.files import atomic_write_text

    try:
        result = pooled_over_seeds(args.runs)
    except (FileNotFoundError, ValueError) as err:
        print(f"rlver seeds: {err}", file=sys.stderr)
        return 2
    from rlver_lib.stats import format_p

    table, pooled = result["per_seed"], result["pooled"]
    shown = table.drop(columns="p_method").assign(
        p_value=[format_p(p, m) for p, m in zip(table["p_value"], table["p_method"])])
    print(shown.to_string(index=False, float_format=lambda x: f"{x:.2f}"))
    print(f"pooled over {len(table)} seeds x {result['n_scenarios']} scenarios: {pooled.value:+.2f} "
          f"[{pooled.low:+.2f}, {pooled.high:+.2f}] ({pooled.confidence:.0%} crossed bootstrap over seeds "
          f"and scenarios); {int((table['ci_low'] > 0).sum())} of {len(table)} seeds with a CI above 0, "
          f"{int((table['ci_high'] < 0).sum())} below")
    if args.json:
        atomic_write_text(Path(args.json), json.dumps({"per_seed": table.to_dict(orient="records"),
                                                       "pooled": asdict(pooled),
                                                       "n_scenarios": result["n_scenarios"]}, indent=2))
    return 0


def _cmd_judge_agreement(args: argparse.Namespace) -> int:
    configure_threads(None)
    from rlver_lib.evaluation.agreement import judge_agreement_command

    return judge_agreement_command(args.files, params=args.params, overrides=args.set, sample=args.sample,
                                   dialogues=args.dialogues, seed=args.seed, json_out=args.json,
                                   progress=not args.no_progress, permutations=args.permutations,
                                   retest_seed=args.retest_seed, exclude_profiles=args.exclude_profiles)


def _cmd_sage_score(args: argparse.Namespace) -> int:
    configure_threads(None)
    from rlver_lib.evaluation.sage import sage_score_command

    return sage_score_command(args.files, as_json=args.json)


def _cmd_scenarios_validate(args: argparse.Namespace) -> int:
    from rlver_lib.scenarios import validate_command

    return validate_command(args.file)


def _cmd_models_prepare(args: argparse.Namespace) -> int:
    configure_threads(None)
    from rlver_lib.models import prepare_embedded

    prepare_embedded()
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    configure_threads(None)
    from rlver_lib.doctor import report

    return report(policy=not args.no_policy, simulator=not args.no_simulator,
                  binary=args.llama_server, model_path=args.simulator_gguf,
                  remeasure_repack=args.remeasure_repack)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``rlver`` command (sub-commands as in docs/ARCHITECTURE.md "Code map")."""
    parser = argparse.ArgumentParser(prog="rlver", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def with_params(name: str, help_text: str, positional: str,
                    progress: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.add_argument(positional)
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="dotted config override, e.g. training.steps=4 (repeatable)")
        if progress:
            p.add_argument("--no-progress", action="store_true", help="hide progress bars")
        return p

    with_params("run", "run the pipeline notebooks for a params file", "params") \
        .set_defaults(func=_cmd_run)
    with_params("eval", "the benchmark alone (base model, or policy.adapter) -> "
                "outputs/<run_name>/eval/<label>/", "params", progress=False) \
        .set_defaults(func=_cmd_eval)
    with_params("ablate", "run every cell of an ablation grid, then compare", "grid") \
        .set_defaults(func=_cmd_ablate)

    seeds = sub.add_parser("seeds", help="paired differences (eval/paired.json) of runs of one recipe "
                           "trained with different seeds, per seed and pooled")
    seeds.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders, e.g. outputs/laptop-ppo-seed*")
    seeds.add_argument("--json", default=None, metavar="OUT", help="also write the figures as JSON to OUT")
    seeds.set_defaults(func=_cmd_seeds)

    sage = sub.add_parser("sage-score", help="score SAGE-format transcript files")
    sage.add_argument("files", nargs="+")
    sage.add_argument("--json", action="store_true", help="print JSON instead of a table")
    sage.set_defaults(func=_cmd_sage_score)

    agree = sub.add_parser("judge-agreement", help="replay SAGE result files through the benchmark judge's "
                           "appraisal and compare its changes with SAGE's recorded ones")
    agree.add_argument("files", nargs="+", metavar="FILE", help="SAGE result files (*_result.jsonl)")
    agree.add_argument("--params", default=None, help="params file whose evaluation.judge is assessed "
                       "(default: the built-in settings)")
    agree.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="dotted config override, e.g. evaluation.judge.backend=rule (repeatable)")
    agree.add_argument("--sample", type=int, default=None, metavar="N", help="replay N turns drawn at random")
    agree.add_argument("--dialogues", type=int, default=64, metavar="D",
                       help="replay every turn of at least D dialogues, drawn by profile with every file's "
                       "dialogue of each (default 64; 0 = all); the report says how many were drawn")
    agree.add_argument("--seed", type=int, default=0, metavar="S",
                       help="seed of the turn sample, the bootstrap and the permutation test")
    agree.add_argument("--permutations", type=int, default=2000, metavar="B",
                       help="within-dialogue permutations of the partial-correlation test (default 2000)")
    agree.add_argument("--retest-seed", type=int, default=None, metavar="R",
                       help="replay the same turns again with the judge seeded R and report the test-retest "
                       "noise of a dialogue's final emotion (doubles the judge's work)")
    agree.add_argument("--json", default=None, metavar="OUT", help="write the figures as JSON to OUT")
    agree.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    agree.add_argument("--exclude-profiles", default=None, metavar="JSON",
                       help="leave out the SAGE profiles in the turns of an earlier result JSON (e.g. the "
                            "calibration's), so the figures come from profiles that chose nothing")
    agree.set_defaults(func=_cmd_judge_agreement)

    scen = sub.add_parser("scenarios", help="scenario files").add_subparsers(
        dest="scenarios_command", required=True)
    validate = scen.add_parser("validate", help="validate a scenario file")
    validate.add_argument("file")
    validate.set_defaults(func=_cmd_scenarios_validate)

    models = sub.add_parser("models", help="embedded models").add_subparsers(
        dest="models_command", required=True)
    models.add_parser("prepare", help="convert the embedded GGUF models into the cache") \
        .set_defaults(func=_cmd_models_prepare)

    doctor = sub.add_parser("doctor", help="CPU features, native builds, threads and a smoke "
                            "generation of each embedded model (each in its own process)")
    doctor.add_argument("--no-policy", action="store_true", help="skip the policy smoke test")
    doctor.add_argument("--no-simulator", action="store_true", help="skip the simulator smoke test")
    doctor.add_argument("--llama-server", type=Path, help="a llama-server binary to test instead of the build")
    doctor.add_argument("--simulator-gguf", type=Path, help="a GGUF file to serve instead of the embedded simulator")
    doctor.add_argument("--remeasure-repack", action="store_true",
                        help="measure again whether llama-server's weight repacking pays on this machine")
    doctor.set_defaults(func=_cmd_doctor)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rlver`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    with sigterm_as_interrupt():  # SIGTERM unwinds like Ctrl-C: servers stop, the manifest is kept right
        try:
            return args.func(args)
        except ConfigError as err:
            print(f"rlver: invalid configuration:\n{err}", file=sys.stderr)
            return 2
        except PipelineError as err:
            print(f"rlver: {err}", file=sys.stderr)
            return 1
        except RunInterrupted as err:
            # the stage's abandoned kernel client may log "Task exception was never
            # retrieved ... DeadKernelError" at exit, after the line below: not news
            logging.getLogger("asyncio").setLevel(logging.CRITICAL)
            command = shlex.join(["rlver", *(sys.argv[1:] if argv is None else argv)])
            print(f"rlver: {err}; to resume, run the same command again (finished stages are skipped, "
                  f"training resumes from its last checkpoint): {command}", file=sys.stderr)
            return err.exit_status
        except KeyboardInterrupt as err:
            print(f"rlver: interrupted by {'SIGTERM' if isinstance(err, Terminated) else 'SIGINT'}",
                  file=sys.stderr)
            return 143 if isinstance(err, Terminated) else 130


if __name__ == "__main__":
    sys.exit(main())
