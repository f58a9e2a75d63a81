#!/usr/bin/env bash
# The real API clients host/tests/serve.rs drives (host/tests/clients/clients.py):
# the official openai SDK and the webuiapi A1111 client, pinned, in
# target/client-venv (about 10 s and 30 MB from PyPI; kept while the pins hold).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/client-venv
pins="openai==3.57.0 webuiapi==0.9.17"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.pins" 2>/dev/null)" != "$pins" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  # shellcheck disable=SC2086 # the pins are words
  "$venv/bin/pip" install -q --disable-pip-version-check $pins
  echo "$pins" > "$venv/.pins"
fi
