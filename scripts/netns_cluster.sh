#!/usr/bin/env bash
# Test hosts on one machine (docs/multi_host.md): N Linux network namespaces,
# each with its own host name (a UTS namespace) and address, joined by veth
# pairs to a bridge that no real interface is attached to, each host's link
# shaped with tc. Traffic never leaves the machine: the hosts have no default
# route and the bridge's subnet is routed nowhere.
#
#   scripts/netns_cluster.sh up N [--shape FILE] [--slots S]
#   scripts/netns_cluster.sh down
#   scripts/netns_cluster.sh status          exit 0 when a cluster is up
#   scripts/netns_cluster.sh rsh HOST CMD... Open MPI's rsh agent: CMD on HOST
#   scripts/netns_cluster.sh loss K PERCENT  host K's link drops PERCENT of its
#                                            packets each way (0: none); nftables
#
# `up` writes $HSPMD_NETNS_DIR (default /run/hspmd-netns):
#   hostfile   Open MPI's syntax, "hspmd-hK slots=S" per host (S default 4)
#   env        what to `source` before `hspmd train --hostfile`: the rsh agent
#              (this script's `rsh`) and TCP restricted to the bridge's subnet
#   hosts      "NAME ADDRESS NETNS" per host
# A failed or interrupted `up` removes what it made; `down` removes every namespace, veth,
# the bridge, the directory, and ends every process left in a namespace.
#
# The shape file: one line per rule, `#` comments; `* RATE DELAY` for every
# host, `K RATE DELAY` for host K (later lines win); RATE as tc writes it
# (100mbit, 1gbit), DELAY 0 or e.g. 2ms. Each host's link is shaped both
# ways (its egress in the namespace, its ingress on the bridge's side):
# rate by tbf, a delay by netem, which some kernels lack (then `up` fails
# and says so). Without --shape: 1gbit, no delay.
set -euo pipefail

DIR="${HSPMD_NETNS_DIR:-/run/hspmd-netns}"
# Two clusters can be up at once when they differ in HSPMD_NETNS_PREFIX,
# HSPMD_NETNS_SUBNET and HSPMD_NETNS_DIR (the env file exports all three).
PREFIX="${HSPMD_NETNS_PREFIX:-hspmd}"     # namespaces hspmd-h0.., veths hspmd-v0.., bridge hspmd-br
SUBNET="${HSPMD_NETNS_SUBNET:-10.213.7}"  # host K is $SUBNET.(K+1), the bridge $SUBNET.254
[[ "$PREFIX" =~ ^[a-z][a-z0-9]{0,7}$ ]] || { echo "netns_cluster: error: HSPMD_NETNS_PREFIX must be 1-8 of [a-z0-9], got '$PREFIX'" >&2; exit 1; }
[[ "$SUBNET" =~ ^10\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || { echo "netns_cluster: error: HSPMD_NETNS_SUBNET must look like 10.X.Y, got '$SUBNET'" >&2; exit 1; }
BRIDGE="${PREFIX}-br"
IFACE="hnet0"             # every host's interface, inside its namespace

die() { echo "netns_cluster: error: $*" >&2; exit 1; }
ns_of() { echo "${PREFIX}-h$1"; }
veth_of() { echo "${PREFIX}-v$1"; }

# The hosts a cluster has: from the hosts file, else whatever namespaces,
# veths and UTS files of ours exist (a half-made cluster).
known_hosts() {
  {
    ip netns list 2>/dev/null | awk '{print $1}' | sed -n "s/^${PREFIX}-h\([0-9]\+\)$/\1/p"
    ip -o link show 2>/dev/null | sed -n "s/^[0-9]*: ${PREFIX}-v\([0-9]\+\)[@:].*/\1/p"
    ls "$DIR" 2>/dev/null | sed -n 's/^h\([0-9]\+\)\.uts$/\1/p'
  } | sort -un
}

# Every process whose network namespace is host K's (ranks, orted, shells).
ns_pids() {
  ip netns pids "$(ns_of "$1")" 2>/dev/null || true
}

down() {
  local k pid left
  for k in $(known_hosts); do
    for pid in $(ns_pids "$k"); do kill -TERM "$pid" 2>/dev/null || true; done
  done
  for _ in $(seq 1 50); do
    left=0
    for k in $(known_hosts); do [ -n "$(ns_pids "$k")" ] && left=1; done
    [ "$left" = 0 ] && break
    sleep 0.1
  done
  for k in $(known_hosts); do
    for pid in $(ns_pids "$k"); do kill -KILL "$pid" 2>/dev/null || true; done
  done
  for k in $(known_hosts); do
    ip link del "$(veth_of "$k")" 2>/dev/null || true
    ip netns del "$(ns_of "$k")" 2>/dev/null || true
    if [ -e "$DIR/h$k.uts" ]; then
      umount "$DIR/h$k.uts" 2>/dev/null || true
      rm -f "$DIR/h$k.uts"
    fi
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  rm -rf "$DIR"
}

# "RATE DELAY" for host K from the shape file (defaults without one).
RATES=()
DELAYS=()
read_shape() {
  local n=$1 file=$2 k
  for ((k = 0; k < n; ++k)); do RATES[k]=1gbit; DELAYS[k]=0; done
  [ -n "$file" ] || return 0
  [ -r "$file" ] || die "--shape $file: cannot read it"
  local line which rate delay extra lineno=0
  while IFS= read -r line || [ -n "$line" ]; do
    lineno=$((lineno + 1))
    line="${line%%#*}"
    read -r which rate delay extra <<<"$line" || true
    [ -n "${which:-}" ] || continue
    [ -n "${delay:-}" ] && [ -z "${extra:-}" ] ||
      die "--shape $file:$lineno: expected 'HOST RATE DELAY' (HOST a number or *), got '$line'"
    [[ "$rate" =~ ^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit)$ ]] ||
      die "--shape $file:$lineno: rate '$rate' is not like 100mbit or 1gbit"
    [[ "$delay" =~ ^(0|[0-9]+(\.[0-9]+)?(us|ms|s))$ ]] ||
      die "--shape $file:$lineno: delay '$delay' is not 0 or like 2ms"
    if [ "$which" = "*" ]; then
      for ((k = 0; k < n; ++k)); do RATES[k]=$rate; DELAYS[k]=$delay; done
    elif [[ "$which" =~ ^[0-9]+$ ]] && [ "$which" -lt "$n" ]; then
      RATES[which]=$rate
      DELAYS[which]=$delay
    else
      die "--shape $file:$lineno: host '$which' is not * or a number below $n"
    fi
  done <"$file"
}

# Shapes the egress of interface DEV (in namespace NS, "" = here).
shape() {
  local ns=$1 dev=$2 rate=$3 delay=$4 host=$5
  local run=()
  [ -n "$ns" ] && run=(ip netns exec "$ns")
  # tbf's bucket: at least 64 KiB (a GSO packet), about 1 ms of the rate.
  local burst="64kb"
  if [ "$delay" = 0 ]; then
    "${run[@]}" tc qdisc add dev "$dev" root handle 1: tbf rate "$rate" burst "$burst" latency 100ms ||
      die "host $host: tc cannot shape $dev to $rate"
  else
    "${run[@]}" tc qdisc add dev "$dev" root handle 1: netem delay "$delay" 2>/dev/null ||
      die "host $host: delay $delay needs the kernel's netem qdisc (CONFIG_NET_SCH_NETEM), which this kernel lacks"
    "${run[@]}" tc qdisc add dev "$dev" parent 1: handle 2: tbf rate "$rate" burst "$burst" latency 100ms ||
      die "host $host: tc cannot shape $dev to $rate"
  fi
}

up_host() {
  local k=$1 slots=$2
  local ns veth addr name
  ns=$(ns_of "$k"); veth=$(veth_of "$k"); addr="$SUBNET.$((k + 1))"; name="$ns"
  ip netns add "$ns"
  ip link add "$veth" type veth peer name "$IFACE" netns "$ns"
  ip link set "$veth" master "$BRIDGE"
  ip link set "$veth" up
  ip netns exec "$ns" sh -c "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6" 2>/dev/null || true
  ip netns exec "$ns" ip link set lo up
  ip netns exec "$ns" ip addr add "$addr/24" dev "$IFACE"
  ip netns exec "$ns" ip link set "$IFACE" up
  # One TCP segment a frame (no GSO packets of many segments): the counters
  # then count one Ethernet, IP and TCP header per segment a socket reports.
  ip netns exec "$ns" ip link set "$IFACE" gso_max_segs 1 || die "host $k: ip cannot set gso_max_segs"
  ip link set "$veth" gso_max_segs 1 || die "host $k: ip cannot set gso_max_segs"
  # Its own host name: a UTS namespace kept by a bind mount on $DIR/hK.uts.
  : >"$DIR/h$k.uts"
  unshare --uts="$DIR/h$k.uts" hostname "$name"
  shape "$ns" "$IFACE" "${RATES[k]}" "${DELAYS[k]}" "$k"
  shape "" "$veth" "${RATES[k]}" "${DELAYS[k]}" "$k"
  echo "$name slots=$slots" >>"$DIR/hostfile"
  echo "$name $addr $ns" >>"$DIR/hosts"
}

write_env() {
  local self
  self="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
  cat >"$DIR/env" <<EOF
# Source before \`hspmd train --hostfile $DIR/hostfile\` (scripts/netns_cluster.sh).
export OMPI_MCA_plm_rsh_agent="$self rsh"
export OMPI_MCA_plm_rsh_no_tree_spawn=1
export OMPI_MCA_btl_tcp_if_include=$SUBNET.0/24
export OMPI_MCA_oob_tcp_if_include=$SUBNET.0/24
# The hosts share this machine's cores: a rank waiting for a message yields.
export OMPI_MCA_mpi_yield_when_idle=1
export HSPMD_NETNS_DIR=$DIR
export HSPMD_NETNS_PREFIX=$PREFIX
export HSPMD_NETNS_SUBNET=$SUBNET
EOF
}

up() {
  local n=$1 shape_file=$2 slots=$3
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 64 ] || die "up N: N must lie in [1, 64], got '$n'"
  [[ "$slots" =~ ^[0-9]+$ ]] && [ "$slots" -ge 1 ] || die "--slots must be a positive integer, got '$slots'"
  [ "$(id -u)" = 0 ] || die "up needs root (network namespaces, veths, a bridge)"
  for tool in ip tc unshare nsenter hostname; do
    command -v "$tool" >/dev/null || die "$tool is not installed (scripts/install_deps.sh installs iproute2)"
  done
  if [ -e "$DIR" ] || ip link show "$BRIDGE" >/dev/null 2>&1 || [ -n "$(known_hosts)" ]; then
    die "a cluster is already up (scripts/netns_cluster.sh down removes it)"
  fi
  read_shape "$n" "$shape_file"
  trap 'echo "netns_cluster: up failed; removing what it made" >&2; down' EXIT
  trap 'exit 130' INT TERM  # interrupted: the EXIT trap removes what was made
  mkdir -p "$DIR"
  : >"$DIR/hostfile"
  : >"$DIR/hosts"
  ip link add "$BRIDGE" type bridge
  ip link set "$BRIDGE" up
  # The launcher's side (mpirun runs here): an address on the bridge, so the
  # hosts' Open MPI daemons reach it; nothing routes the subnet elsewhere.
  ip addr add "$SUBNET.254/24" dev "$BRIDGE"
  for ((k = 0; k < n; ++k)); do up_host "$k" "$slots"; done
  write_env
  trap - EXIT INT TERM
}

# `loss K PERCENT`: host K's link turns lossy: an nftables table in its
# namespace drops each packet through its interface, either way, with
# probability PERCENT/100 (`numgen random`; the kernel may lack netem, whose
# `loss` would do this in tc). 0 removes the table.
loss() {
  [ $# -eq 2 ] || die "usage: loss K PERCENT"
  local k=$1 pct=$2 ns
  [[ "$pct" =~ ^[0-9]+$ ]] && [ "$pct" -le 100 ] || die "loss: PERCENT must be an integer in [0, 100], got '$pct'"
  [[ "$k" =~ ^[0-9]+$ ]] || die "loss: host '$k' is not a number"
  ns=$(ns_of "$k")
  ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$ns" || die "loss: no test host $k (namespace $ns)"
  command -v nft >/dev/null || die "loss: nft is not installed (scripts/install_deps.sh installs nftables)"
  ip netns exec "$ns" nft delete table inet hspmd_loss 2>/dev/null || true
  [ "$pct" = 0 ] && return 0
  ip netns exec "$ns" nft -f - <<RULES || die "loss: host $k: nft refused the rules (a kernel without nf_tables or numgen?)"
table inet hspmd_loss {
  chain in { type filter hook input priority 0; policy accept; iifname "$IFACE" numgen random mod 100 < $pct drop; }
  chain out { type filter hook output priority 0; policy accept; oifname "$IFACE" numgen random mod 100 < $pct drop; }
}
RULES
}

# Open MPI's rsh agent: `rsh HOST CMD...` runs CMD in HOST's namespaces (as
# ssh would run it in HOST's login shell).
rsh() {
  [ $# -ge 2 ] || die "rsh HOST CMD..."
  local host=$1
  shift
  local k=""
  [ -r "$DIR/hosts" ] && k=$(awk -v h="$host" '$1 == h || $2 == h {print $3}' "$DIR/hosts")
  [ -n "$k" ] || die "rsh: no test host '$host' (is the cluster up? see $DIR/hosts)"
  local uts="$DIR/h${k##*-h}.uts"
  exec nsenter --net="/run/netns/$k" --uts="$uts" -- /bin/sh -c "$*"
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  up)
    [ $# -ge 1 ] || die "usage: up N [--shape FILE] [--slots S]"
    n=$1; shift
    shape_file=""; slots=4
    while [ $# -gt 0 ]; do
      case "$1" in
        --shape) [ $# -ge 2 ] || die "--shape needs a file"; shape_file=$2; shift 2 ;;
        --slots) [ $# -ge 2 ] || die "--slots needs a number"; slots=$2; shift 2 ;;
        *) die "up: unknown argument '$1'" ;;
      esac
    done
    up "$n" "$shape_file" "$slots"
    ;;
  down)
    # `down N` is accepted too: every host of ours goes, whatever N.
    down
    ;;
  status)
    [ -r "$DIR/hosts" ] && cat "$DIR/hosts"
    ;;
  rsh) rsh "$@" ;;
  loss) loss "$@" ;;
  *) die "usage: $0 up N [--shape FILE] [--slots S] | down | status | rsh HOST CMD... | loss K PERCENT" ;;
esac
