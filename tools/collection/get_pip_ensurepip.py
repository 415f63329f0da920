"""A stand-in for the get-pip.py script ansible-test downloads to put pip into its empty test venvs.

ansible-test creates each sanity test's virtual environment without pip, then runs
`python get_pip_X_Y.py [pip options] pip==X.Y [--no-setuptools] [--no-wheel]` from its cache
(~/.ansible/test/cache/get_pip_X_Y.py), downloading the script first when the cache lacks it - from
a host our build machines cannot reach (tools/collection/sanity.sh pre-seeds the cache with this
file). The same result without that download: pip from the interpreter's own ensurepip, then the
pip version ansible-test asks for from the machine's configured package index (pip.conf, PIP_*).
"""

import subprocess
import sys

# In a child: ensurepip.bootstrap() in this process would set PIP_CONFIG_FILE=/dev/null here (it
# hides pip.conf from its own pip run), and the install below would no longer see the index.
subprocess.check_call([sys.executable, "-m", "ensurepip", "--upgrade"], stdout=subprocess.DEVNULL)
# get-pip.py's own options (ours never installs setuptools or wheel unless asked, so they go).
args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", *args])
