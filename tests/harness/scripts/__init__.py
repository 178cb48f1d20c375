"""Plain training programs, as a user would write them: none imports upd. The launcher's tests record them with
`upd record RUN -- python SCRIPT` (tests/integrations/test_launcher.py)."""
import os

SCRIPTS_DIR = os.path.dirname(os.path.abspath(__file__))


def script(name: str) -> str:
    """The path of the script `name` (e.g. "train_mlp.py")."""
    return os.path.join(SCRIPTS_DIR, name)
