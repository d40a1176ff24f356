"""A module that starts a thread when imported: a launcher must refuse to fork after it."""

import threading

threading.Thread(target=threading.Event().wait, args=(30,), daemon=True).start()
