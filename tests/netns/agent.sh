#!/bin/sh
# Launcher agent standing in for ssh between the namespace "hosts" of cluster.sh.
#
# mpiexec (PRRTE) calls it as ssh:  agent.sh HOST WORD...  where the words make
# one shell command line (prted and its options). HOST is a namespace name
# (PREFIX-hI) or an address of one; the command runs in that namespace with its
# own hostname, as ssh would run it on that host. Use it with
#   mpiexec --prtemca plm_ssh_agent /path/to/agent.sh ...
# MATEX_NETNS_AGENT_LOG=FILE appends one line per launch (for diagnostics).
set -eu

[ $# -ge 2 ] || { echo "usage: $0 HOST COMMAND..." >&2; exit 2; }
host=$1
shift

if [ -e "/run/netns/$host" ]; then
    ns=$host
else
    # an address: look for it among the namespaces of the caller's cluster
    self=$(ip netns identify $$ 2>/dev/null || true)
    prefix=${self%-h*}
    ns=
    for cand in $(ip netns list | awk '{print $1}'); do
        case "$cand" in "$prefix"-h*) ;; *) continue ;; esac
        if ip -n "$cand" -o -4 addr show | awk '{print $4}' | grep -qx "$host/[0-9]*"; then
            ns=$cand
            break
        fi
    done
    [ -n "$ns" ] || { echo "agent.sh: no namespace of cluster '$prefix' has address $host" >&2; exit 255; }
fi

if [ -n "${MATEX_NETNS_AGENT_LOG:-}" ]; then
    echo "$(date +%T.%N) $host -> $ns: $*" >> "$MATEX_NETNS_AGENT_LOG"
fi
# "$*": the words joined by spaces, to be read by a shell -- exactly what ssh does
# shellcheck disable=SC2016  # $0 and $1 expand in the inner shell
exec ip netns exec "$ns" unshare --uts -- sh -c 'hostname "$0" && eval "$1"' "$ns" "$*"
