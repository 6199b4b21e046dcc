# Put this folder on PYTHONPATH to make every Python process dump its stacks periodically (diagnosis only).
import faulthandler
import os

_dir = os.environ.get("STACKDUMP_DIR")
if _dir:
    _f = open(os.path.join(_dir, f"stack-{os.getpid()}.txt"), "w")
    faulthandler.dump_traceback_later(int(os.environ.get("STACKDUMP_EVERY", "60")), repeat=True, file=_f)
