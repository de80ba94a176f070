"""native: what serving.run loads and training fine-tunes; drafters/storage/artifact.py defines and reads it."""

from drafters.storage.artifact import write_native
from export.formats import ANY_DRAFTER, Format, register

register(Format("native", ANY_DRAFTER, write=write_native))
