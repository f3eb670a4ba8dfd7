#!/bin/sh
# A SHELL for make that logs each recipe line's wall seconds: where `make test`'s time before pytest goes.
#
#   make SHELL=$PWD/benchmarks/timed_shell.sh TIMED_SHELL_LOG=/tmp/steps.log test-deps setup lint
#   sort -rn /tmp/steps.log | head
started=$(date +%s.%N)
/bin/sh "$@"
code=$?
ended=$(date +%s.%N)
printf '%7.2f  %s\n' "$(echo "$ended - $started" | bc)" "$(echo "$2" | tr '\n' ' ' | cut -c1-150)" \
  >> "${TIMED_SHELL_LOG:-/tmp/timed-shell.log}"
exit $code
