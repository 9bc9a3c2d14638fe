#!/usr/bin/env bash
# Regenerates data/corpus/*.txt: verbatim copies of the GNU license texts that
# Debian ships in /usr/share/common-licenses (package base-files). No network.
# Each of these texts says: "Everyone is permitted to copy and distribute
# verbatim copies of this license document, but changing it is not allowed."
set -euo pipefail

src=/usr/share/common-licenses
dest="$(cd "$(dirname "$0")/.." && pwd)/data/corpus"
files=(GPL-1 GPL-2 GPL-3 LGPL-2 LGPL-2.1 LGPL-3 GFDL-1.2 GFDL-1.3)

mkdir -p "$dest"
for f in "${files[@]}"; do
  if [[ ! -f "$src/$f" ]]; then
    echo "make_corpus: $src/$f is missing (install Debian's base-files package)" >&2
    exit 1
  fi
  cp "$src/$f" "$dest/$f.txt"
done
echo "make_corpus: wrote ${#files[@]} files to $dest ($(cat "$dest"/*.txt | wc -c) bytes)"
