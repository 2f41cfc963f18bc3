# Sourced by scripts/setup.sh and scripts/lab-env.sh: `installer_init PYTHON [UV]`, then
# `install ARGS...` installs into PYTHON's venv (as `pip install -q ARGS...`).
#
# The installs go through uv where it can be had (UV if given, else uv from PyPI into that venv):
# it downloads and unpacks in parallel, and resolves the same versions; the project's setup on a
# 2-core machine took 150 s with pip and 74 s with uv (issue 32: the suite's time). pip's settings
# of where packages lie (find-links, index and extra index URLs, a constraint file, from pip.conf or
# PIP_*) are handed to uv, which does not read them, and a file:// location that is not on this
# machine is skipped, as pip skips it. A uv that cannot be had or fails falls back to pip;
# JUPYTER_RING_SETUP_PIP=1 uses pip alone. `$installer` says which ("uv" or "pip").

installer_init() {
  _installer_py=$1
  _installer_uv=${2:-}
  _installer_args=()
  installer=pip
  [ -z "${JUPYTER_RING_SETUP_PIP:-}" ] || return 0
  if [ -z "$_installer_uv" ] || [ ! -x "$_installer_uv" ]; then
    "$_installer_py" -m pip install -q uv >/dev/null 2>&1 || return 0
    _installer_uv=$(dirname "$_installer_py")/uv
  fi
  [ -x "$_installer_uv" ] || return 0
  local key value location path
  while IFS='=' read -r key value; do
    value=${value#\'}; value=${value%\'}
    for location in $value; do
      path=${location#file://}
      case "$key" in
        *.find-links) [ -e "$path" ] && _installer_args+=(--find-links "$location") ;;
        *.index-url) { [ "$path" = "$location" ] || [ -e "$path" ]; } && _installer_args+=(--index-url "$location") ;;
        *.extra-index-url) { [ "$path" = "$location" ] || [ -e "$path" ]; } && _installer_args+=(--extra-index-url "$location") ;;
        *.constraint) [ -e "$path" ] && _installer_args+=(--constraint "$path") ;;
      esac
    done
  done < <("$_installer_py" -m pip config list 2>/dev/null)  # pip.conf's, and PIP_*'s as ":env:"
  _installer_args+=(--index-strategy unsafe-best-match)  # as pip: the best version from any index
  # and as pip, each installed module compiled to bytecode: a Python that cannot write __pycache__
  # (PYTHONDONTWRITEBYTECODE=1, as on these hosts; a student in the root-owned lab venv) otherwise
  # compiles torch's source at every import
  _installer_args+=(--compile-bytecode)
  installer=uv
}

install() {
  if [ "$installer" = uv ]; then
    "$_installer_uv" pip install -q -p "$_installer_py" "${_installer_args[@]}" "$@" && return 0
    echo "[install] uv could not install $*; pip instead"
  fi
  pip_quiet "$_installer_py" install "$@"
}

pip_quiet() {  # PYTHON ARGS...: PYTHON -m pip -q ARGS, without the notes about absent local index folders
  local py=$1
  shift
  "$py" -m pip -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  return "${PIPESTATUS[0]}"
}
