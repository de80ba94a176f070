"""Bad user input and how every entry point reports it.

The contract (docs/errors.md): a user mistake prints one `error: ...` line naming
the culprit and exits 2, before anything on disk is touched; an unexpected exception keeps its
traceback, says it is a bug, and exits 1.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import re
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


def command(config_name: str):
    """`@command("train")` on a command's `main(cfg)`: Hydra composes conf/<config_name>.yaml with the
    command line, and `entry_point` reports what goes wrong. The command line is composed once
    beforehand, so that what Hydra itself refuses (an unknown key or group, an option that does not
    exist, an override it cannot parse, a run dir it cannot make) is one line and exit 2 too, not
    Hydra's message and exit 1. Command lines with Hydra's flags (`--cfg`, `-m`, ...) are Hydra's."""

    def decorate(main):
        import hydra

        run_hydra = hydra.main(version_base=None, config_path="../conf", config_name=config_name)(entry_point(main))

        @functools.wraps(main)
        def run():
            args = sys.argv[1:]
            if not any(arg.startswith("-") for arg in args):
                entry_point(check_command_line)(config_name, args)
            return run_hydra()

        return run

    return decorate


def check_command_line(config_name: str, overrides: list[str]) -> None:
    """Raise a UserError naming the first override that Hydra would refuse, or a run dir it cannot make."""
    from hydra import compose, initialize_config_module
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import (
        ConfigCompositionException,
        HydraException,
        MissingConfigException,
        OverrideParseException,
    )
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_overrides([override])
        except OverrideParseException as error:
            raise UserError(f"{override}: not a valid override ({str(error).splitlines()[0]}; quote a value "
                            f"with brackets, commas or spaces)") from None

    def composed(given: list[str]):
        with initialize_config_module("conf", version_base=None):
            return compose(config_name, overrides=given, return_hydra_config=True)

    try:
        cfg = composed(overrides)
    except MissingConfigException as error:  # a group option that has no YAML file
        group = os.path.dirname(error.missing_cfg_file or "")
        wrong = next((o for o in overrides if o.split("=")[0].lstrip("+~") == group), error.missing_cfg_file)
        raise UserError(f"{wrong}: must be one of {' | '.join(error.options or [])}") from None
    except ConfigCompositionException as error:
        unknown = re.match(r"Could not override '([^']+)'", str(error))
        if not unknown:  # e.g. `a=1,2` without -m: Hydra's message says what to write instead
            raise UserError(" ".join(str(error).split())) from None
        key = unknown.group(1)
        parent = key.rpartition(".")[0]
        try:
            node = OmegaConf.select(composed([o for o in overrides if o.split("=")[0] != key]), parent or "")
            known = [name for name in node.keys() if name != "hydra"]
        except (HydraException, OmegaConfBaseException, AttributeError):  # the rest fails too: named next time
            known = []
        raise no_such_setting(key, known) from None
    try:
        run_dir = str(cfg.hydra.run.dir)
    except OmegaConfBaseException:  # an interpolation of the app's own keys: the settings check names it
        return
    if not run_dir.strip():  # Hydra would run in the working directory, among the user's files
        raise UserError("hydra.run.dir=: must not be empty")
    from drafters.storage.writes import check_creatable, check_run_dir

    check_creatable(run_dir, "hydra.run.dir")
    check_run_dir(run_dir, model_dir_ok=config_name != "train")  # before Hydra writes its log there

