#!/bin/sh
# A small "cluster" of network namespaces on one machine, for multi-host MPI tests.
#
#   cluster.sh up   PREFIX NHOSTS   create PREFIX-sw (a switch: one bridge) and
#                                   PREFIX-h0 .. PREFIX-h<N-1>, each with eth0 plugged
#                                   into the switch, address SUBNET.(i+1), lo up
#   cluster.sh down PREFIX          delete every namespace named PREFIX-*
#   cluster.sh run  PREFIX I CMD... run CMD as host I: in its namespace, with its own
#                                   hostname (PREFIX-h<I>) in a private UTS namespace
#
# The namespaces are not connected to the machine's own network namespace, so
# traffic between the "hosts" never leaves them. Subnet: MATEX_NETNS_SUBNET
# (first three octets, default 198.18.77 -- the RFC 2544 benchmarking range).
# Needs root and iproute2 (ip netns) and util-linux (unshare).
set -eu

subnet=${MATEX_NETNS_SUBNET:-198.18.77}

usage() { sed -n '2,14p' "$0" >&2; exit 2; }

up() {
    prefix=$1 n=$2
    sw="$prefix-sw"
    ip netns add "$sw"
    ip -n "$sw" link set lo up
    ip -n "$sw" link add br0 type bridge
    ip -n "$sw" link set br0 up
    i=0
    while [ "$i" -lt "$n" ]; do
        ns="$prefix-h$i"
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        # both ends are created inside namespaces: no name clash with other runs
        ip -n "$sw" link add "p$i" type veth peer name eth0 netns "$ns"
        ip -n "$sw" link set "p$i" master br0
        ip -n "$sw" link set "p$i" up
        ip -n "$ns" addr add "$subnet.$((i + 1))/24" dev eth0
        ip -n "$ns" link set eth0 up
        i=$((i + 1))
    done
    # name resolution inside the cluster: ip netns exec bind-mounts
    # /etc/netns/NS/hosts over /etc/hosts for whatever runs in NS
    hosts="127.0.0.1 localhost"
    i=0
    while [ "$i" -lt "$n" ]; do
        hosts="$hosts
$subnet.$((i + 1)) $prefix-h$i"
        i=$((i + 1))
    done
    i=0
    while [ "$i" -lt "$n" ]; do
        mkdir -p "/etc/netns/$prefix-h$i"
        printf '%s\n' "$hosts" > "/etc/netns/$prefix-h$i/hosts"
        i=$((i + 1))
    done
}

down() {
    prefix=$1
    for ns in $(ip netns list | awk '{print $1}'); do
        case "$ns" in
            "$prefix"-*)
                # end what still runs in there, then the namespace (veths go with it)
                for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
                ip netns del "$ns" 2>/dev/null || true
                rm -rf "/etc/netns/$ns" ;;
        esac
    done
}

run() {
    prefix=$1 i=$2
    shift 2
    ns="$prefix-h$i"
    # shellcheck disable=SC2016  # $0 and $@ expand in the inner shell
    exec ip netns exec "$ns" unshare --uts -- sh -c 'hostname "$0" && exec "$@"' "$ns" "$@"
}

[ $# -ge 2 ] || usage
cmd=$1
shift
case "$cmd" in
    up) [ $# -eq 2 ] || usage; up "$@" ;;
    down) [ $# -eq 1 ] || usage; down "$@" ;;
    run) [ $# -ge 3 ] || usage; run "$@" ;;
    *) usage ;;
esac
