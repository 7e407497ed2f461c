#!/bin/sh
# Fetch CRIU from Debian trixie into a private prefix, without touching the system's apt state or
# packages, and make a wrapper that runs it with trixie's own loader and libraries.
#
#   scripts/get-criu.sh            # prints progress; its LAST line is the wrapper's path
#   PCCHECK_CRIU=$(scripts/get-criu.sh | tail -n 1)
#
# Why: bookworm's criu 3.17 fails `criu check` on this kernel ("Unexpected rt vDSO area bounds");
# trixie's criu 4.x passes. Installing trixie packages into a bookworm system is never done: the
# .debs are unpacked with `dpkg -x` under PREFIX and run through trixie's ld.so.
#
# Idempotent: a wrapper that already answers `--version` is reused. Exit status 1 (with the reason
# on stderr) when the packages cannot be fetched; callers then run without CRIU (tests skip).
# The wrapper runs as root (CRIU needs it): keep PREFIX where only root can write.
set -eu

PREFIX=${PCCHECK_CRIU_PREFIX:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/pccheck/criu-trixie}
MIRROR=${PCCHECK_CRIU_MIRROR:-http://deb.debian.org/debian}
SUITE=trixie
WRAPPER=$PREFIX/criu
ARCH_DIR=x86_64-linux-gnu

if [ -x "$WRAPPER" ] && "$WRAPPER" --version >/dev/null 2>&1; then
    echo "$WRAPPER"
    exit 0
fi
if [ "$(uname -m)" != x86_64 ]; then
    echo "get-criu.sh: only x86_64 is supported (this is $(uname -m))" >&2
    exit 1
fi
command -v apt-get >/dev/null || { echo "get-criu.sh: apt-get not found (Debian needed)" >&2; exit 1; }

APT=$PREFIX/apt
mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$APT/debs" "$PREFIX/root"
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
echo "deb [signed-by=$KEYRING] $MIRROR $SUITE main" > "$APT/sources.list"
# A private apt: its own sources, lists and cache; the machine's sources and preferences are
# never read, its package state never written. apt_private TOOL ARGS... (TOOL: apt-get, apt-cache)
mkdir -p "$APT/sources.list.d" "$APT/preferences.d"
apt_private() {
    tool=$1
    shift
    "$tool" -q -o Dir::Etc::sourcelist="$APT/sources.list" -o Dir::Etc::sourceparts="$APT/sources.list.d" \
        -o Dir::State::Lists="$APT/lists" -o Dir::Cache="$APT/cache" -o Dir::State::status=/dev/null \
        -o Dir::Etc::preferences=/dev/null -o Dir::Etc::preferencesparts="$APT/preferences.d" \
        -o APT::Sandbox::User=root -o APT::Architecture=amd64 -o APT::Architectures=amd64 "$@"
}
echo "get-criu.sh: reading the $SUITE package lists into $APT" >&2
apt_private apt-get update >&2 || { echo "get-criu.sh: cannot read the $SUITE package lists" >&2; exit 1; }

# criu and the libraries it loads, found by following Depends (library packages only: libc6's own
# dependencies end the walk), resolved against trixie's lists alone.
want="criu"
seen=""
while [ -n "$want" ]; do
    next=""
    for pkg in $want; do
        case " $seen " in *" $pkg "*) continue ;; esac
        seen="$seen $pkg"
        deps=$(apt_private apt-cache depends --no-recommends --no-suggests --no-conflicts --no-breaks \
                   --no-replaces --no-enhances "$pkg" 2>/dev/null |
               sed -n 's/^ *|\{0,1\}Depends: \([^ <>]*\).*/\1/p' | sed 's/:any$//' | sort -u)
        for d in $deps; do
            case "$d" in lib*) next="$next $d" ;; esac
        done
    done
    want=$next
done
echo "get-criu.sh: fetching$seen" >&2
rm -f "$APT"/debs/*.deb  # one version of each package, never a mix from an earlier run
(cd "$APT/debs" && apt_private apt-get download $seen >&2) || { echo "get-criu.sh: download failed" >&2; exit 1; }
for deb in "$APT"/debs/*.deb; do
    dpkg -x "$deb" "$PREFIX/root"
done

R=$PREFIX/root
LOADER=$R/usr/lib/$ARCH_DIR/ld-linux-x86-64.so.2
[ -e "$LOADER" ] || LOADER=$R/lib/$ARCH_DIR/ld-linux-x86-64.so.2
[ -e "$LOADER" ] || { echo "get-criu.sh: trixie's loader is missing under $R" >&2; exit 1; }
[ -x "$R/usr/sbin/criu" ] || { echo "get-criu.sh: criu is missing under $R" >&2; exit 1; }
cat > "$WRAPPER.tmp" <<EOF
#!/bin/sh
# criu from Debian $SUITE, run with its own loader and libraries (made by scripts/get-criu.sh)
exec "$LOADER" --library-path "$R/usr/lib/$ARCH_DIR:$R/lib/$ARCH_DIR" "$R/usr/sbin/criu" "\$@"
EOF
chmod +x "$WRAPPER.tmp"
mv "$WRAPPER.tmp" "$WRAPPER"
"$WRAPPER" --version >&2 || { echo "get-criu.sh: the wrapper does not run" >&2; exit 1; }
echo "$WRAPPER"
