#!/bin/sh
# System packages the test suite uses beyond the venv, installed only where missing and we are root
# (CI machines, containers); anywhere else one line each, and the tests that need them skip saying why.
# It never fails `make test`.
#   slurm-wlm, munge   a real one-node SLURM for tests/distributed/test_slurm.py
#   chromium           a real browser that renders the HTML report (tests/integration/test_report_runs.py)
# --background: return at once and install while the suite starts (apt's ~35 s overlap pip, lint and the
# first tests). The install holds $STATE/lock (flock) while it runs; a test that needs a package waits
# for that lock (tests/support/test_deps.py), and a second `make test` queues behind the first.
STATE=${PRETRAINER_TEST_DEPS_STATE:-/tmp/pretrainer-test-deps-$(id -u)}
if [ "$1" = "--background" ]; then
  mkdir -p "$STATE" && chmod 700 "$STATE"
  if command -v flock >/dev/null 2>&1; then
    nohup flock "$STATE/lock" sh "$0" >>"$STATE/output" 2>&1 &
    echo "install-test-deps: installing what the tests need in the background ($STATE/output)"
    exit 0
  fi
  exec sh "$0"  # no flock: install now, before the tests
fi
log=$STATE/apt.log
mkdir -p "$STATE"
apt_get() { DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq "$@" >>"$log" 2>&1; }
install() {  # $1: the command that shows it is there, $2: the packages, $3: who needs them
  if command -v "$1" >/dev/null 2>&1; then
    return
  elif [ "$(id -u)" != 0 ]; then
    echo "install-test-deps: no $1 and not root: $3 will skip (as root: apt-get install $2)"
  elif ! command -v apt-get >/dev/null 2>&1; then
    echo "install-test-deps: no $1 and no apt-get: $3 will skip (install $2)"
  else
    echo "install-test-deps: installing $2 for $3"
    # daemons a package may start are left alone: the tests' cluster has its own ports and munge socket
    if ! { apt_get $2 || { apt-get update -qq >>"$log" 2>&1 && apt_get $2; }; }; then
      echo "install-test-deps: apt-get install $2 failed (see $log): $3 will skip"
    fi
  fi
}
install sbatch "slurm-wlm munge" "the SLURM tests"
install chromium "chromium" "the report's browser test"
# slurmctld and slurmd find their node by the short hostname: it must resolve
host=$(hostname -s 2>/dev/null)
if [ -n "$host" ] && ! getent hosts "$host" >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && [ -w /etc/hosts ]; then
    echo "127.0.0.1 $host" >>/etc/hosts && echo "install-test-deps: added '127.0.0.1 $host' to /etc/hosts"
  else
    echo "install-test-deps: the hostname $host does not resolve: the SLURM tests will skip"
  fi
fi
exit 0
