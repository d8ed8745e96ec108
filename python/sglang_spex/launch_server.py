"""``python -m sglang_spex.launch_server``: SGLang's launcher plus our ``--tot-*`` / ``--respec-*`` flags and CPU
defaults.

Our flags are parsed here (:func:`sglang_spex.flags.parse_args`; a bad one exits with status 2 naming it, before
any model loads); every other argument goes to SGLang unchanged. The validated
:class:`~sglang_spex.config.PluginConfig` reaches SGLang's processes as JSON in ``SGLANG_SPEX_CONFIG``, which
they inherit.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import errno
import glob
import io
import os
import re
import signal
import socket
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence, Tuple

from sglang_spex.config import (
    FORCE_CPU_ENV_VAR,
    STATS_FILE_PREFIX,
    ConfigError,
    LearnerSpec,
    PluginConfig,
    default_stats_path,
    export,
    flag_value,
    stats_channel,
)
from sglang_spex.flags import add_flags, is_decimal, parse_args
from sglang_spex.serve import PORT_TAKEN
from sglang_spex.tot.validation import is_http_url

# Applied on a machine without a GPU unless the user passed the flag. Values measured on 2-core hosts.
CPU_DEFAULTS: Dict[str, Optional[str]] = {
    "--device": "cpu",
    "--attention-backend": "spex_cpu",  # sgl-kernel-ext: batched CPU attention (1.6x decode at batch 16)
    "--sampling-backend": "pytorch",
    "--max-total-tokens": "32768",
    # SGLang sizes KV as (available after load) - (1 - f) * (available before load): with a small f, memory
    # other processes take meanwhile makes startup fail; --max-total-tokens caps the pool anyway.
    "--mem-fraction-static": "0.5",
    "--dtype": "bfloat16",
    "--sleep-on-idle": None,
    "--disable-cuda-graph": None,
}
# The overlap scheduler stays on, on CPU as on a GPU: it is SGLang's default and what users run, and every plugin hook
# runs in both loops (the suite tests the scheduler hooks in both). On a 2-core shared host it decoded slower (tiny
# Llama, spex_cpu, greedy, tok/s off vs on, interleaved, median of 7, 64 tokens: B=1 149 vs 98, B=4 279 vs 252,
# B=16 423 vs 400); --disable-overlap-schedule (SGLang's flag) turns it off. SGLang itself turns overlap off for
# NGRAM and EAGLE-family speculative decoding on CPU (arg_groups/speculative_hook.py); the launcher keeps it (L1).
DISABLE_OVERLAP = "--disable-overlap-schedule"
ENABLE_OVERLAP = "--enable-overlap-schedule"  # ours, kept for old command lines: overlap on (the default)
CPU_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    # Default torch threading slowed decode 17x on a contended 2-core host; one thread per process.
    "OMP_NUM_THREADS": "1",
}
PRIORITY_POLICIES = ("fcfs", "lof")  # allowed with priority scheduling (SGLang: arg_groups/validation_hook.py)
TOT_DEFAULTS: Dict[str, Optional[str]] = {
    # Speculative requests carry low priorities: let SGLang order by them and evict their KV first.
    "--enable-priority-scheduling": None,
    # Requests without a priority would otherwise rank *below* speculative ones (None = lowest).
    "--default-priority-value": "0",
    "--schedule-policy": "fcfs",
    "--radix-eviction-policy": "priority",
    # Every ToT node is seeded (hook H2). SGLang's flashinfer/intel_xpu top-k/top-p kernels take no seed, so under
    # them such steps would sample unseeded (hook H2c); torch's path keeps them seeded, as SGLang's own
    # --enable-deterministic-inference does. A --sampling-backend the user passes wins.
    "--sampling-backend": "pytorch",
}


MIXED_CHUNK = "--enable-mixed-chunk"  # SGLang's: prefill and the running batch's decode in one forward
THREAD_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"  # SGLang's: the CPU cores of each rank, "a-b|c-d|..."
PARALLEL_FLAGS = {
    "dp": ("--dp-size", "--dp", "--data-parallel-size"),
    "tp": ("--tp-size", "--tp", "--tensor-parallel-size"),
    "pp": ("--pp-size", "--pp", "--pipeline-parallel-size"),
}


def _ranks(args: Sequence[str]) -> Dict[str, int]:
    out = {}
    for kind, names in PARALLEL_FLAGS.items():
        value = next((v for v in (flag_value(args, n) for n in names) if v is not None), "1")
        if not is_decimal(value) or int(value) < 1:
            raise ConfigError(f"{names[0]} {value!r}: expected an integer >= 1")
        out[kind] = int(value)
    return out


def cpu_thread_binding(args: Sequence[str], cores: Sequence[int]) -> Optional[str]:
    """SGLang's per-rank core binding for a CPU server with more than one rank (dp × tp × pp): the machine's
    cores split into that many contiguous groups; None with one rank. Raises :class:`ConfigError` when there
    are more ranks than cores."""
    r = _ranks(args)
    world = r["dp"] * r["tp"] * r["pp"]
    if world <= 1:
        return None
    cores = sorted(cores)
    if world > len(cores):
        raise ConfigError(
            f"--dp-size {r['dp']} x --tp-size {r['tp']} x --pp-size {r['pp']} = {world} ranks, but only "
            f"{len(cores)} CPU cores are available: each CPU rank needs a core of its own"
        )
    size, extra = divmod(len(cores), world)
    groups, start = [], 0
    for i in range(world):
        n = size + (1 if i < extra else 0)
        group = cores[start : start + n]
        start += n
        groups.append(_cpu_list(group))
    return "|".join(groups)


def _int_flag(args: Sequence[str], flag: str, default: int) -> int:
    value = flag_value(args, flag)
    if value is None:
        return default
    if not is_decimal(value):
        raise ConfigError(f"{flag} {value!r}: expected an integer >= 0")
    return int(value)


def bind_group_ids(args: Sequence[str]) -> List[int]:
    """The ``SGLANG_CPU_OMP_THREADS_BIND`` group each rank of a one-node CPU server takes: SGLang 0.5.23 binds a rank
    to the group its ``gpu_id`` indexes (``numa_utils.init_threads_binding``): ``--base-gpu-id`` + dp_rank x tp x pp
    x step + pp_rank x tp + tp_rank x step (``data_parallel_controller``, ``engine``; step: ``--gpu-id-step``). The
    old ``--dp-size N --enable-dp-attention`` splits the TP group instead (``parallel_hook``: no replicas)."""
    layout = _bind_layout(args)
    _, _, dp, pp, tp = layout
    return [_group_id(layout, d, p, t) for d in range(dp) for p in range(pp) for t in range(tp)]


def _group_id(layout: Tuple[int, int, int, int, int], d: int, p: int, t: int) -> int:
    """The group of rank (dp replica ``d``, pp rank ``p``, tp rank ``t``) under ``layout`` (:func:`_bind_layout`)."""
    base, step, _, pp, tp = layout
    return base + d * tp * pp * step + p * tp + t * step


def _bind_layout(args: Sequence[str]) -> Tuple[int, int, int, int, int]:
    """(base gpu id, gpu id step, replicas, pp, tp) of :func:`bind_group_ids`."""
    r = _ranks(args)
    base, step = _int_flag(args, "--base-gpu-id", 0), _int_flag(args, "--gpu-id-step", 1)
    dp = 1 if _given(args, "--enable-dp-attention") and _int_flag(args, "--attn-dp-size", 1) == 1 else r["dp"]
    return base, step, dp, r["pp"], r["tp"]


def check_thread_binding(args: Sequence[str], binding: str, cores: Sequence[int]) -> None:
    """Refuse a user's ``SGLANG_CPU_OMP_THREADS_BIND`` that does not give each rank a group: SGLang fails on a
    missing or empty group only after loading the model. Every group a rank indexes (ranks 0..n-1 by default; see
    :func:`bind_group_ids`) must exist and be non-empty; more groups are allowed (one binding shared by servers of
    different sizes). Multi-node servers (``--nnodes``) are left to SGLang."""
    if _int_flag(args, "--nnodes", 1) > 1:
        return
    groups, layout = binding.split("|"), _bind_layout(args)
    base, step, dp, pp, tp = layout
    need = _group_id(layout, dp - 1, pp - 1, tp - 1) + 1  # the largest group id + 1
    g = len(groups)
    if g >= need and all(  # d and t past g repeat ids (step 0) or cannot occur (need <= g): at most g^2 ids read
        groups[_group_id(layout, d, p, t)].strip()
        for d in range(min(dp, g))
        for p in range(pp)
        for t in range(min(tp, g))
    ):
        return
    default_layout = base == 0 and step == 1  # the ids are 0..n-1
    try:
        example = f" (e.g. {cpu_thread_binding(args, cores) or _cpu_list(cores)})" if default_layout else ""
    except ConfigError:  # more ranks than cores: no example
        example = ""
    raise ConfigError(
        f"{THREAD_BIND_ENV}={binding!r} has {len(groups)} group(s), but this server's {dp * pp * tp} CPU rank(s) "
        f"(--dp-size x --tp-size x --pp-size) need {need} non-empty '|'-separated groups{example}"
    )


def check_learner_spec(spec: LearnerSpec) -> None:
    """Refuse ``--respec-learner`` URLs and probe sequences that would fail only at the learner's first update or
    publish, naming the field."""
    for i, url in enumerate([spec.server_url, *spec.replica_urls]):
        name = "server_url" if i == 0 else f"replica_urls[{i - 1}]"
        if (url is not None or i > 0) and not is_http_url(url):
            raise ConfigError(f"--respec-learner {name}: {url!r} is not an http(s) URL")
    for i, pair in enumerate(spec.probe):
        ok = len(pair) == 2 and all(seq and all(type(t) is int and t >= 0 for t in seq) for seq in pair)
        if not ok:
            raise ConfigError(f"--respec-learner probe[{i}]: expected [prompt_ids, response_ids], non-empty, ids >= 0")


def _cpu_list(cores: Sequence[int]) -> str:
    """Cores in the ``a-b,c`` form (contiguous runs as ranges)."""
    runs: List[List[int]] = []
    for c in cores:
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def has_gpu() -> bool:
    """True when torch sees a CUDA device (``SPEX_FORCE_CPU=1`` says no)."""
    if os.environ.get(FORCE_CPU_ENV_VAR) == "1":
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _given(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _apply(args: List[str], defaults: Dict[str, Optional[str]]) -> List[str]:
    out = list(args)
    for flag, value in defaults.items():
        if not _given(out, flag):
            out += [flag] if value is None else [flag, value]
    return out


def build_sglang_args(cfg: PluginConfig, rest: Sequence[str], gpu: bool) -> List[str]:
    """SGLang's argument list: the user's flags, then our defaults for whatever they left out."""
    overlap = ENABLE_OVERLAP in rest
    args = [a for a in rest if a != ENABLE_OVERLAP]
    if not _given(args, "--model-path") and not _given(args, "--model"):
        from sglang_spex.models import default_model_path

        args += ["--model-path", str(default_model_path())]
    model = flag_value(args, "--model-path") or flag_value(args, "--model")
    if model is not None and not Path(model).exists() and model.startswith(("/", ".", "~")):
        raise ConfigError(f"--model-path {model}: no such file or directory")
    if overlap and _given(args, DISABLE_OVERLAP):
        raise ConfigError(f"{ENABLE_OVERLAP} and {DISABLE_OVERLAP} contradict each other")
    if not gpu:
        args = _apply(args, CPU_DEFAULTS)
    if cfg.spex.enabled:
        args = _apply(args, TOT_DEFAULTS)
        policy = flag_value(args, "--schedule-policy")
        if policy not in PRIORITY_POLICIES:  # SGLang's check_server_args would assert after seconds of start-up
            raise ConfigError(
                f"--schedule-policy {policy}: --tot-speculation ranks speculative requests below primaries with "
                f"SGLang's priority scheduling, which SGLang allows only with --schedule-policy "
                f"{' or '.join(PRIORITY_POLICIES)} (the default under --tot-speculation is fcfs)"
            )
        if cfg.spex.mixed_prefill and not _given(args, "--speculative-algorithm"):
            args = _apply(args, {MIXED_CHUNK: None})  # speculative prefill rides the primaries' decode step
    return args


def set_cpu_env() -> None:
    """``CPU_ENV`` where the user set nothing (before SGLang or torch is imported: both read it then)."""
    for key, value in CPU_ENV.items():
        os.environ.setdefault(key, value)


def prepare(argv: Sequence[str], gpu: Optional[bool] = None) -> List[str]:
    """Parse our flags, export the config for SGLang's processes, return SGLang's arguments.

    ``gpu``: whether to treat the machine as having a GPU (default: :func:`has_gpu`).
    """
    cfg, rest = parse_args(argv)
    gpu = has_gpu() if gpu is None else gpu
    args = build_sglang_args(cfg, rest, gpu)
    if cfg.respec.enabled:
        from sglang_spex.profile.cache import Profile
        from sglang_spex.respec.eagle_policy import running_cap_args, sglang_adaptive_args

        if cfg.respec.profile != "auto":  # read now: a bad file fails here, not in the scheduler at every step
            try:
                Profile.load(cfg.respec.profile)
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ConfigError(f"--respec-profile {cfg.respec.profile!r}: not a readable ReSpec profile ({e})")

        # EAGLE: SGLang's adaptive flags (they lift the cap too); NGRAM: only SGLang's speculative cap of 48 lifted
        args += sglang_adaptive_args(cfg.respec, args) if cfg.respec.eagle else running_cap_args(cfg.respec, args)
    if cfg.learner is not None:
        check_learner_spec(cfg.learner)
    user_binding = os.environ.get(THREAD_BIND_ENV)
    if user_binding and flag_value(args, "--device") == "cpu":  # SGLang reads it on CPU only
        check_thread_binding(args, user_binding, sorted(os.sched_getaffinity(0)))
    if not cfg.stats_path:
        remove_stale_rings(os.path.dirname(default_stats_path()))
    cfg = dataclasses.replace(cfg, stats_path=cfg.stats_path or default_stats_path())
    export(cfg)
    if not gpu:
        set_cpu_env()
        if not user_binding:  # the user's binding wins; SGLang needs one for > 1 rank on CPU
            binding = cpu_thread_binding(args, sorted(os.sched_getaffinity(0)))
            if binding is not None:
                os.environ[THREAD_BIND_ENV] = binding
    return args


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


RING_NAME = re.compile(r"(\d+)(?:\.\d+)?(?:\.tmp(\d+))?")  # <launcher pid>[.<rank>][.tmp<writer pid>]
RING_SUFFIX = re.compile(r"(?:\.\d+)?(?:\.tmp\d+)?")  # what follows a stats path: [.<rank>][.tmp<writer pid>]


def _unlink(paths: Sequence[str]) -> List[str]:
    removed = []
    for path in paths:
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def remove_stale_rings(directory: str) -> List[str]:
    """Unlink the rings in ``directory`` of servers whose launcher is gone (``sglang-spex-stats-<pid>[.<rank>]``,
    ``config.default_stats_path``), and the ``.tmp<pid>`` files of ring writers that died before renaming theirs
    (the writer's pid is gone): SGLang ends its scheduler processes with a signal, so their writers' ``atexit`` never
    runs, and each ring left behind holds ~2 MB of ``/dev/shm`` (memory). Returns the paths removed."""
    stale = []
    for path in glob.glob(os.path.join(glob.escape(directory), STATS_FILE_PREFIX + "*")):
        m = RING_NAME.fullmatch(os.path.basename(path)[len(STATS_FILE_PREFIX) :])
        if m is not None and not _pid_alive(int(m.group(2) or m.group(1))):
            stale.append(path)
    return _unlink(stale)


def remove_rings(stats_path: str) -> List[str]:
    """Unlink this server's rings: ``<stats_path>``, ``<stats_path>.<rank>`` and their writers' ``.tmp<pid>`` files
    (call once the scheduler processes are gone). Returns the paths removed."""
    found = glob.glob(glob.escape(stats_path) + "*")
    return _unlink([p for p in found if RING_SUFFIX.fullmatch(p[len(stats_path) :])])


def allow_spec_overlap_on_cpu() -> None:
    """Touch point L1: on CPU, speculative decoding keeps the overlap scheduler unless ``--disable-overlap-schedule``.

    SGLang 0.5.23 turns overlap off for every speculative algorithm on CPU
    (``arg_groups.speculative_hook._disable_overlap_schedule_for_cpu``). NGRAM's overlap path runs on CPU as it is;
    the EAGLE family's needs hook V2 (``srt/cpu_overlap.py``: its draft-state relay gathers with a Triton kernel).
    Greedy output equals plain SGLang's in both modes (``test/respec/test_adaptive_server.py``,
    ``test_adaptive_eagle.py``)."""
    from sglang.srt.arg_groups import speculative_hook

    speculative_hook._disable_overlap_schedule_for_cpu = keep_overlap


def keep_overlap(server_args) -> None:
    """Replacement of SGLang's CPU guard: leave ``disable_overlap_schedule`` as the launcher resolved it."""


def check_port_free(args: Sequence[str]) -> None:
    """Exit with status 2, before any model loads, when SGLang's HTTP port (``--host``/``--port``, SGLang's defaults
    127.0.0.1:30000) is taken: uvicorn would report it only after the model loaded, and then neither serve nor
    exit. Bound as uvicorn binds (SO_REUSEADDR); another process can still take the port before uvicorn does."""
    host = flag_value(args, "--host") or "127.0.0.1"
    text = flag_value(args, "--port") or "30000"
    if not (is_decimal(text) and int(text) <= 65535):  # (0: the system picks one, as bind does)
        _refuse(f"--port {text!r}: expected a port number in 0..65535")
    port = int(text)
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        _refuse(f"--host {host!r}: cannot resolve it ({e})")
    try:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            _refuse(f"--port {port}: {PORT_TAKEN} on {host} ({e})")
        _refuse(f"--host {host} --port {port}: cannot listen there ({e})")


def _refuse(message: str) -> NoReturn:
    print(f"sglang_spex.launch_server: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def print_help() -> None:
    """Our flags (generated from the config's fields), then SGLang's own help."""
    parser = argparse.ArgumentParser(prog="python -m sglang_spex.launch_server", add_help=False)
    parser.add_argument(ENABLE_OVERLAP, action="store_true", help="overlap scheduler on (the default, CPU included)")
    add_flags(parser)
    print(parser.format_help())
    from sglang.srt.server_args import prepare_server_args

    prepare_server_args(["--help"])  # prints SGLang's flags and exits


def sglang_server_args(parse: Callable[[List[str]], Any], args: List[str]) -> Any:
    """SGLang's ``ServerArgs`` from ``args``; a flag SGLang refuses exits 2 with its one error line and the closest
    flags it knows, instead of SGLang's usage text (hundreds of lines)."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            server_args = parse(args)
    except SystemExit as e:
        text = captured.getvalue()
        if e.code != 2 or "usage:" not in text:
            sys.stderr.write(text)
            raise
        before, usage = text.split("usage:", 1)
        sys.stderr.write(before)  # warnings printed before the parser gave up
        error = next((ln for ln in reversed(usage.splitlines()) if "error:" in ln), usage.strip()[-300:])
        bad = re.findall(r"--[a-z0-9][a-z0-9-]*", error.split("error:", 1)[-1])
        known = set(re.findall(r"--[a-z0-9][a-z0-9-]*", usage.replace(error, ""))) - set(bad)
        near = difflib.get_close_matches(bad[0], known, n=3) if bad else []
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        print(f"sglang_spex.launch_server: SGLang {error.strip()}{hint}", file=sys.stderr)
        raise SystemExit(2) from None
    sys.stderr.write(captured.getvalue())
    return server_args


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print_help()
        return
    try:
        args = prepare(argv)
    except ConfigError as e:
        _refuse(str(e))
    check_port_free(args)
    if not has_gpu():
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    if not has_gpu() and not _given(args, DISABLE_OVERLAP):
        allow_spec_overlap_on_cpu()
    server_args = sglang_server_args(prepare_server_args, args)
    rings = stats_channel()
    # SGLang replaces this handler once it serves (its own drains, then ends launch_server): both reach the cleanup
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        launch_server(server_args)
    finally:
        try:
            kill_process_tree(os.getpid(), include_parent=False)
        finally:
            remove_rings(rings)  # the schedulers' writers never unlink theirs (they end by a signal)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM before SGLang handles it: exit through ``main``'s cleanup (children killed, rings removed)."""
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    main()
