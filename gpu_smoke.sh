#!/usr/bin/env bash
# GPU smoke of the half-precision compiled plans (issue 24 item 2), run by the lead on the GPU machine
# from the repo root after `python3 build.py`, with PYTHONPATH=/tmp/site:$PWD. Prints one line per
# model (plan steps or compiled partitions, max relative error against float32, replay) and the
# pytest summary; under 3 minutes.
set -u
export HALF_PLANS_REPORT=${HALF_PLANS_REPORT:-/tmp/half_plans_report.txt}
rm -f "$HALF_PLANS_REPORT"
git log -1 --format='commit %h %s' 2>/dev/null || true
timeout 170 python3 -m pytest tests/plugin_cuda/test_half_plans.py -m gpu -q --timeout=120 -rfE -p no:cacheprovider 2>&1 | tail -60
rc=${PIPESTATUS[0]}
echo "---- per-model report ----"
cat "$HALF_PLANS_REPORT" 2>/dev/null || echo "(no report lines)"
exit "$rc"
