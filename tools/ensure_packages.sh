#!/bin/sh
# ensure_packages.sh WHAT "TOOLS" "PACKAGES": install PACKAGES with apt-get when one of TOOLS is
# missing and apt-get can be used here (root). Never fails: without them, WHAT skips and says so.
what=$1 tools=$2 packages=$3
missing=""
for tool in $tools; do
  command -v "$tool" >/dev/null 2>&1 || [ -x "$tool" ] || missing="$missing $tool"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "$what:$missing missing and apt-get is not usable here (it will skip)"
  exit 0
fi
echo "$what: installing $packages (missing:$missing)"
{ DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $packages \
  || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $packages; }; } \
  >/dev/null 2>&1 || echo "warning: apt-get could not install $packages; $what will skip"
exit 0
