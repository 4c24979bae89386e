"""`python lm_eval_own_tasks.py -m MODULE ARGS...`: `python -m MODULE ARGS...` (lm_eval, or
conveyor's eval) with lm-eval's task index holding the `--include_path` folder's tasks alone.

lm-eval indexes the ~14,000 task YAMLs it ships on every run (12-17 s on a slow CPU) before it
looks for the tasks asked for; these tests ask only for their own. One test
(`test_conveyor_eval_matches_lm_eval_hf`) runs lm-eval as it is, its bundled tasks indexed too.
"""

from __future__ import annotations

import runpy
import sys

from lm_eval.tasks import manager

_index_tasks = manager.TaskManager.__init__


def _own_tasks_only(self, *args, include_defaults: bool = True, **kwargs) -> None:
    _index_tasks(self, *args, include_defaults=False, **kwargs)


if __name__ == "__main__":
    if sys.argv[1:2] != ["-m"] or len(sys.argv) < 3:
        sys.exit("usage: lm_eval_own_tasks.py -m MODULE [ARGS...]")
    manager.TaskManager.__init__ = _own_tasks_only
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
