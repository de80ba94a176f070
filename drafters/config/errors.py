"""Bad user input and how every entry point reports it (drafters/config/command.py: how a command's
command line is checked before Hydra runs it).

The contract (docs/errors.md): a user mistake prints one `error: ...` line naming
the culprit and exits 2, before anything on disk is touched; an unexpected exception keeps its
traceback, says it is a bug, and exits 1.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import sys
import traceback

USER_MISTAKE, BUG, INTERRUPTED = 2, 1, 130


class UserError(Exception):
    """Bad input from the user (file, config, model mismatch); the message names the culprit."""


class MainProcessFailed(UserError):
    """In the other processes of a multi-process run: the main process stopped on a user mistake
    (and printed it) while they waited for it."""


def no_such_setting(key: str, known: list[str]) -> UserError:
    """The error for a setting `key` that its config node (whose settings are `known`) lacks."""
    name = key.rpartition(".")[2]
    close = [k for k in known if k.startswith(name) or name.startswith(k)] + difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return UserError(f"{key}: no such setting" + (f" ({hint}the settings here: {', '.join(known)})" if known else ""))


def fail(message: str) -> None:
    """Print `error: <message>` as one line and exit 2. In the other processes of a multi-process
    run, before their process group exists, the same checks fail on the same input: only rank 0
    prints."""
    torch = sys.modules.get("torch")
    grouped = torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized()
    if os.environ.get("RANK", "0") != "0" and not grouped:
        sys.exit(USER_MISTAKE)
    bars = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(bars, "tqdm", None), "_instances", [])):
        bar.close()  # a progress bar left open would hold the start of the error's line
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    sys.exit(USER_MISTAKE)


def entry_point(main):
    """Wrap a command's main (under `@hydra.main`): UserError and the operating system's refusals
    (a missing directory, no permission, a full disk) become one line and exit 2; Ctrl-C exits 130
    without a traceback; anything else is a bug and says so."""

    @functools.wraps(main)
    def run(*args, **kwargs):
        logging.raiseExceptions = False  # a log line that cannot be written (a full disk) is dropped, not a traceback
        try:
            return main(*args, **kwargs)
        except MainProcessFailed:
            sys.exit(USER_MISTAKE)
        except UserError as error:
            fail(str(error))
        except OSError as error:  # the message names the file and what the system refused
            where = f"{error.filename}: " if error.filename else ""
            fail(f"{where}{error.strerror or error}")
        except KeyboardInterrupt:
            print("error: interrupted (every file written so far is complete or absent)", file=sys.stderr)
            sys.exit(INTERRUPTED)
        except Exception:
            traceback.print_exc()
            print("error: this is a bug in specdraft, not a mistake in your input: please report it "
                  "with the traceback above", file=sys.stderr)
            sys.exit(BUG)

    return run
