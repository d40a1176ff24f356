"""A module run by the launcher's tests: says where and how it runs, then exits as told."""

import os
import sys
import time

from grove_events import new_id

#: Made while the launcher imports this module, before it forks: its children must not go on
#: from the same random state.
new_id()

if __name__ == "__main__":
    print(f"name={__name__} argv={sys.argv[1:]} cwd={os.getcwd()} mark={os.environ.get('MARK')}")
    print(f"pid={os.getpid()} id={new_id()}")
    behaviour = os.environ.get("BEHAVIOUR", "exit")
    if behaviour == "raise":
        raise RuntimeError("told to fail")
    if behaviour == "sleep":
        time.sleep(60)
    raise SystemExit(int(os.environ.get("EXIT_CODE", "0")))
