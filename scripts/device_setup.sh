#!/usr/bin/env bash
# Source on the GPU node: installs carried wheels into /tmp/site and puts them and src/ on PYTHONPATH.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
# the git revision this copy was made from (scripts/device_stamp.py; carry .devstamp): manifests record it
eval "$(python3 scripts/device_stamp.py env)"
