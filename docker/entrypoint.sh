#!/bin/sh
# Entry point of the MaTEx image (docker/Dockerfile).
#
#   entrypoint.sh [MATEXRUN ARGS...]   run matexrun (default: the demo on 2 ranks)
#   entrypoint.sh sshd                 be a worker node: serve ssh on $MATEX_SSH_PORT
#                                      (2222) as this (non-root) user
#
# Multi-container clusters (docker/compose.yaml): set MATEX_CLUSTER_DIR to a
# volume shared by every container. The first container creates the cluster's
# ssh key there; every one trusts it. The head (the container running
# matexrun) waits until the ssh servers of MATEX_WAIT_FOR (host names,
# space-separated) answer, then starts matexrun, whose mpiexec reaches them
# through ssh. Host names are the containers' (compose: the service names).
set -eu

port=${MATEX_SSH_PORT:-2222}
cluster=${MATEX_CLUSTER_DIR:-}
ssh_dir=$HOME/.ssh

log() { echo "entrypoint: $*" >&2; }

cluster_key() {
    # made once, by the first container that gets the lock (mkdir is atomic)
    if [ ! -f "$cluster/id_ed25519.pub" ] && mkdir "$cluster/.keylock" 2>/dev/null; then
        ssh-keygen -q -t ed25519 -N "" -C matex-cluster -f "$cluster/key.tmp"
        mv "$cluster/key.tmp" "$cluster/id_ed25519"
        mv "$cluster/key.tmp.pub" "$cluster/id_ed25519.pub"
    fi
    waited=0
    while [ ! -f "$cluster/id_ed25519.pub" ]; do
        [ "$waited" -lt 60 ] || { log "no cluster key in $cluster after 60 s"; exit 1; }
        sleep 1
        waited=$((waited + 1))
    done
    mkdir -p "$ssh_dir"
    chmod 700 "$ssh_dir"
    cp "$cluster/id_ed25519" "$ssh_dir/id_ed25519"
    chmod 600 "$ssh_dir/id_ed25519"
    cp "$cluster/id_ed25519.pub" "$ssh_dir/authorized_keys"
    cat > "$ssh_dir/config" <<CONFIG
Host *
    Port $port
    IdentityFile $ssh_dir/id_ed25519
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    LogLevel ERROR
    BatchMode yes
CONFIG
}

serve_ssh() {
    [ -f "$ssh_dir/host_ed25519" ] || ssh-keygen -q -t ed25519 -N "" -f "$ssh_dir/host_ed25519"
    cat > "$ssh_dir/sshd_config" <<CONFIG
Port $port
HostKey $ssh_dir/host_ed25519
PidFile $ssh_dir/sshd.pid
AuthorizedKeysFile $ssh_dir/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
CONFIG
    log "sshd on port $port for $(id -un)"
    exec /usr/sbin/sshd -D -e -f "$ssh_dir/sshd_config"
}

wait_for_hosts() {
    for host in ${MATEX_WAIT_FOR:-}; do
        waited=0
        until ssh -F "$ssh_dir/config" -o ConnectTimeout=2 "$host" true 2>/dev/null; do
            [ "$waited" -lt 120 ] || { log "$host: no ssh after 120 s"; exit 1; }
            sleep 1
            waited=$((waited + 1))
        done
        log "$host is up"
    done
}

if [ -n "$cluster" ]; then
    cluster_key
    # Open MPI's daemons are started with this ssh configuration
    PRTE_MCA_plm_ssh_args="-F $ssh_dir/config"
    export PRTE_MCA_plm_ssh_args
fi

if [ "${1:-}" = "sshd" ]; then
    [ -n "$cluster" ] || { log "sshd needs MATEX_CLUSTER_DIR (the shared key)"; exit 2; }
    serve_ssh
fi

wait_for_hosts
exec matexrun "$@"
