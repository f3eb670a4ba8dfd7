#!/bin/sh
# System packages the test suite uses beyond the venv: a real SLURM (slurm-wlm, munge) for
# tests/distributed/test_slurm.py, whose fixture starts a private one-node cluster. Installed only
# where sbatch is missing and we are root (CI machines, containers); anywhere else this prints one
# line and the SLURM tests skip with the reason. It never fails `make test`.
log=/tmp/install-test-deps.log
skip="the SLURM tests will skip"
apt_install() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >>"$log" 2>&1
}
if command -v sbatch >/dev/null 2>&1; then
  :
elif [ "$(id -u)" != 0 ]; then
  echo "install-test-deps: no sbatch and not root: $skip (as root: apt-get install slurm-wlm munge)"
elif ! command -v apt-get >/dev/null 2>&1; then
  echo "install-test-deps: no sbatch and no apt-get: $skip (install slurm-wlm and munge)"
else
  echo "install-test-deps: installing slurm-wlm and munge for the SLURM tests (~15 s)"
  # daemons the package may start are left alone: the tests' cluster has its own ports and munge socket
  : >"$log"
  if ! { apt_install || { apt-get update -qq >>"$log" 2>&1 && apt_install; }; }; then
    echo "install-test-deps: apt-get install slurm-wlm munge failed (see $log): $skip"
  fi
fi
# slurmctld and slurmd find their node by the short hostname: it must resolve
host=$(hostname -s 2>/dev/null)
if [ -n "$host" ] && ! getent hosts "$host" >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && [ -w /etc/hosts ]; then
    echo "127.0.0.1 $host" >>/etc/hosts && echo "install-test-deps: added '127.0.0.1 $host' to /etc/hosts"
  else
    echo "install-test-deps: the hostname $host does not resolve: $skip"
  fi
fi
exit 0
