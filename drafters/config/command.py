"""`@command`: every entry point's Hydra main, with its command line checked first, so that what Hydra
itself refuses is one `error:` line too (drafters/config/errors.py)."""

from __future__ import annotations

import functools
import os
import re
import sys

from drafters.config.errors import UserError, entry_point, no_such_setting
from drafters.storage.writes import check_creatable, check_run_dir


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
    check_creatable(run_dir, "hydra.run.dir")
    check_run_dir(run_dir, model_dir_ok=config_name != "train")  # before Hydra writes its log there

