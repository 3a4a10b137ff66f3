"""The edges every deltacast process shares: exit codes, one-line errors, signals.

Both ends run as commands (``deltacast demo`` / ``report`` / ``bench`` on the engine
side, ``deltacast worker`` -- or ``python -m worker_side.main`` when the demo spawns
it -- on the worker side), and both follow one policy, kept here because the two
sides share only :mod:`protocol` (no sockets, threads or clock in this module):

* an expected failure is one line on stderr, ``PROG: what went wrong; what to do``,
  and a distinct exit code from :data:`EXIT_CODES` (:class:`CliError`); a bad
  command line is exit 2 with one line (:class:`Parser`);
* SIGINT and SIGTERM are handled alike (:func:`install_signal_handlers`): the first
  one raises :class:`Interrupted` in the main thread, ``finally`` blocks clean up
  (further signals are ignored meanwhile, and :func:`deferred_signals` holds one
  back until a cleanup section is done), then one line and exit 128 + signal; an
  :class:`Interrupted` that lands where Python cannot raise (a ``__del__`` or weakref
  callback, which only prints "Exception ignored") is delivered again;
* anything else is a bug: ``PROG: internal error: ... (traceback in PATH)``, the
  traceback written to a log file, exit :data:`EXIT_INTERNAL`;
* ``--debug`` also prints the traceback of any failure; ``-v`` makes the logs
  verbose (a successful run is otherwise quiet on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import tempfile
import textwrap
import traceback
from collections.abc import Callable, Iterator
from types import FrameType

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_JOIN_TIMEOUT = 3
EXIT_ENGINE_SILENT = 4
EXIT_INCOMPATIBLE = 5
EXIT_ENDPOINT = 6
EXIT_IN_USE = 7
EXIT_NO_INPUT = 8
EXIT_CANNOT_WRITE = 9
EXIT_MISSING_DEPENDENCY = 10
EXIT_WORKERS_LOST = 11
EXIT_INTERNAL = 70
EXIT_SIGINT = 128 + signal.SIGINT
EXIT_STDOUT_CLOSED = 141  # 128 + SIGPIPE, as a tool killed by SIGPIPE would exit
EXIT_SIGTERM = 128 + signal.SIGTERM

#: (code, meaning): the table of ``deltacast --help``
EXIT_CODES: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "success"),
    (EXIT_FAILED, "the run finished but failed its checks (demo: a request unfinished, "
                  "ranks disagreed, or --reference differed)"),
    (EXIT_USAGE, "bad command line (unknown option, value out of range)"),
    (EXIT_JOIN_TIMEOUT, "worker: heard nothing from the engine within --join-timeout"),
    (EXIT_ENGINE_SILENT, "worker: the engine went silent for --engine-timeout"),
    (EXIT_INCOMPATIBLE, "engine and worker speak incompatible protocol versions"),
    (EXIT_ENDPOINT, "endpoint refused (ipc directory not private or not creatable, tcp "
                    "without CURVE keys or --insecure, a key file without its secret)"),
    (EXIT_IN_USE, "address in use (tcp port taken, or another engine holds the ipc "
                  "directory)"),
    (EXIT_NO_INPUT, "an input file is missing, unreadable or not what was expected"),
    (EXIT_CANNOT_WRITE, "an output path cannot be written"),
    (EXIT_MISSING_DEPENDENCY, "an optional dependency (vLLM) is not installed"),
    (EXIT_WORKERS_LOST, "demo: workers did not join in time, or kept failing"),
    (EXIT_INTERNAL, "internal error (a bug): the traceback is in the log file named"),
    (EXIT_SIGINT, "interrupted by SIGINT (Ctrl-C); cleaned up"),
    (EXIT_STDOUT_CLOSED, "stdout was closed (e.g. piped into head); nothing printed"),
    (EXIT_SIGTERM, "terminated by SIGTERM; cleaned up"),
)


def exit_codes_text() -> str:
    """The exit-code table as help text."""
    return "exit codes:\n" + "\n".join(
        textwrap.fill(text, 80, initial_indent=f"  {code:>3}  ", subsequent_indent=" " * 7)
        for code, text in EXIT_CODES)


class CliError(Exception):
    """An expected failure: one line (what went wrong and what to do) and an exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived (a BaseException, like KeyboardInterrupt, so that
    ``except Exception`` does not swallow it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.code = 128 + signum


class StdoutClosed(Exception):
    """Whoever read our stdout went away (``| head``): end quietly."""


def one_line(text: object, limit: int = 600) -> str:
    """``text`` on one line (newlines folded), at most ``limit`` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


# -- argument types -------------------------------------------------------------------------
def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``low..high`` (no upper bound if None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            span = f"at least {low}" if high is None else f"between {low} and {high}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def float_in(low: float, high: float | None = None, *,
             exclusive: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number ≥ ``low`` (> ``low`` if ``exclusive``), ≤ ``high``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        too_low = value <= low if exclusive else value < low
        if value != value or value in (float("inf"), float("-inf")) or too_low or (
                high is not None and value > high):
            bound = f"more than {low:g}" if exclusive else f"at least {low:g}"
            if high is not None:
                bound += f" and at most {high:g}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def endpoint(text: str) -> str:
    """An argparse type: ``ipc://DIR`` or ``tcp://HOST:PORT`` (PORT + 1 is used too).
    Whether DIR is private is checked where it is opened (:mod:`protocol.ipc_dir`)."""
    if text.startswith("ipc://"):
        if not text[len("ipc://"):].strip("/"):
            raise argparse.ArgumentTypeError(f"{text!r} names no directory: use ipc://DIR, "
                                             "e.g. ipc:///tmp/dc-mine")
        return text
    if text.startswith("tcp://"):
        host, sep, port = text[len("tcp://"):].rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65534:
            raise argparse.ArgumentTypeError(
                f"{text!r}: a tcp endpoint is tcp://HOST:PORT with PORT in 1..65534 (the "
                "engine also uses PORT+1)")
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not an endpoint: use ipc://DIR or "
                                     "tcp://HOST:PORT")


# -- parser and help --------------------------------------------------------------------------
class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written; each option's default after its help
    (unless the help already names it, or there is nothing to show)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default == [] or default == ""
                or default is argparse.SUPPRESS or "default" in text.lower()
                or isinstance(action, argparse._CountAction)
                or (not action.option_strings and action.nargs not in ("?", "*"))):
            return text
        if isinstance(default, (tuple, list)):
            shown = ",".join(str(v) for v in default)
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (and exit 2), with :class:`HelpFormatter`."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: {one_line(message)} (see {self.prog} --help)\n")


def add_common_flags(parser: argparse.ArgumentParser, *, inherited: bool = False) -> None:
    """``--debug`` and ``-v``; ``inherited``: on a subcommand, where the top level has
    them too (a SUPPRESS default keeps ``deltacast -v demo`` meaningful)."""
    debug_default: object = argparse.SUPPRESS if inherited else False
    verbose_default: object = argparse.SUPPRESS if inherited else 0
    parser.add_argument("--debug", action="store_true", default=debug_default,
                        help="print the traceback of any failure (for bug reports)")
    parser.add_argument("-v", "--verbose", action="count", default=verbose_default,
                        help="more messages on stderr (-v: progress and counters, -vv: "
                             "debug); a successful run is otherwise quiet")


def configure_logging(verbosity: int, label: str) -> None:
    """stderr logging: our warnings (and other libraries' errors) by default, INFO with
    -v (other libraries' warnings too), DEBUG with -vv."""
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 \
        else logging.DEBUG
    logging.basicConfig(level=logging.ERROR if verbosity <= 0 else level, stream=sys.stderr,
                        force=True, format=f"%(asctime)s {label} %(levelname)s %(message)s")
    logging.getLogger("deltacast").setLevel(level)


# -- signals ------------------------------------------------------------------------------------
class _SignalState:
    raised = False  # an Interrupted is unwinding: later signals are ignored
    pending: int | None = None  # a signal held back by deferred_signals
    shield = 0
    unraisable: Callable[[sys.UnraisableHookArgs], object] = sys.__unraisablehook__


_state = _SignalState()
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if _state.raised:
        return
    if _state.shield:
        _state.pending = signum
        return
    _state.raised = True
    raise Interrupted(signum)


def _on_unraisable(unraisable: sys.UnraisableHookArgs) -> None:
    """An Interrupted raised inside a finalizer or weakref callback is swallowed there:
    raise it again at the main thread's next call (a one-shot profile function, whose
    exception Python raises in the profiled frame), outside this hook."""
    exc = unraisable.exc_value
    if not (isinstance(exc, Interrupted) and _state.raised):
        _state.unraisable(unraisable)  # whoever handled them before
        return
    before = sys.getprofile()

    def raise_at_next_call(frame: FrameType, event: str, arg: object) -> None:
        if frame.f_code is _on_unraisable.__code__:
            return  # this hook's own calls and return
        sys.setprofile(before)
        raise Interrupted(exc.signum)

    sys.setprofile(raise_at_next_call)


def install_signal_handlers() -> dict[int, object]:
    """SIGINT and SIGTERM raise :class:`Interrupted` (once); returns the previous handlers
    (main thread only; elsewhere nothing is installed)."""
    _state.raised, _state.pending, _state.shield = False, None, 0
    try:
        previous: dict[int, object] = {
            sig: signal.signal(sig, _on_signal) for sig in HANDLED_SIGNALS}
    except ValueError:  # not the main thread
        return {}
    if sys.unraisablehook is not _on_unraisable:
        _state.unraisable, sys.unraisablehook = sys.unraisablehook, _on_unraisable
    return previous


def restore_signal_handlers(previous: dict[int, object]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)  # type: ignore[arg-type]
    if previous and sys.unraisablehook is _on_unraisable:
        sys.unraisablehook = _state.unraisable


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """A cleanup section: a signal arriving inside is raised when it ends (if it ends
    normally), so the cleanup itself is never cut short."""
    _state.shield += 1
    try:
        yield
    finally:
        _state.shield -= 1
    if not _state.shield and _state.pending is not None and not _state.raised:
        signum, _state.pending = _state.pending, None
        _state.raised = True
        raise Interrupted(signum)


# -- the guard -----------------------------------------------------------------------------------
def internal_error_log(prog: str, exc: BaseException) -> str:
    """Write ``exc``'s traceback to a fresh log file; returns its path."""
    fd, path = tempfile.mkstemp(prefix="deltacast-internal-error-", suffix=".log")
    with os.fdopen(fd, "w") as out:
        out.write(f"{prog} (pid {os.getpid()}): {' '.join(sys.argv)}\n\n")
        out.write("".join(traceback.format_exception(exc)))
    return path


def guarded(prog: str, body: Callable[[], int], *, debug: Callable[[], bool]) -> int:
    """Run ``body`` under the policy of the module docstring; returns the exit status.

    ``debug`` is asked after a failure (the command line may not be parsed yet)."""
    previous = install_signal_handlers()
    try:
        return body()
    except CliError as exc:
        _traceback_if(debug)
        print(f"{prog}: {one_line(exc)}", file=sys.stderr)
        return exc.code
    except (Interrupted, KeyboardInterrupt) as exc:
        _traceback_if(debug)
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        print(f"{prog}: interrupted by {signal.Signals(signum).name}; stopped cleanly",
              file=sys.stderr)
        return 128 + signum
    except StdoutClosed:
        with contextlib.suppress(OSError):  # no flush at exit into the closed pipe
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return EXIT_STDOUT_CLOSED
    except Exception as exc:
        _traceback_if(debug)
        try:
            where = internal_error_log(prog, exc)
        except OSError as log_exc:
            where = f"not written: {log_exc}"
        print(f"{prog}: internal error: {type(exc).__name__}: {one_line(exc, 300)} "
              f"(traceback in {where}; please report it)", file=sys.stderr)
        return EXIT_INTERNAL
    finally:
        restore_signal_handlers(previous)
        _state.raised, _state.pending, _state.shield = False, None, 0


def _traceback_if(debug: Callable[[], bool]) -> None:
    with contextlib.suppress(Exception):
        if debug():
            traceback.print_exc()
