#!/usr/bin/env bash
# GPU evidence for issue 24 after lm_head's pipelined loop and the routing count at the step end
# (2026-11-27). Its sections (ablate, stages, and wave4.sh's tests, b1, outside, bench) now live in
# wave7.sh, which this runs:
#   bash scripts/device/wave6.sh tests b1 outside bench ablate   # ... and the step taken apart (H200)
#   bash scripts/device/wave6.sh b1 outside bench stages tests   # ... and lm_head_stages 0 / 3 (H100)
exec bash "$(dirname "$0")/wave7.sh" "$@"
