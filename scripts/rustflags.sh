# Sourced by scripts/test and .ci/run. The build needs `--cfg tokio_unstable`
# (src/runtime.rs), which .cargo/config.toml sets; but a RUSTFLAGS or
# CARGO_ENCODED_RUSTFLAGS variable in the environment replaces that setting
# instead of adding to it, so add the flag to whichever one is set.
if [ -n "${CARGO_ENCODED_RUSTFLAGS+x}" ]; then
    case "$CARGO_ENCODED_RUSTFLAGS" in
        *tokio_unstable*) ;;
        "") export CARGO_ENCODED_RUSTFLAGS=$'--cfg\x1ftokio_unstable' ;;
        *) export CARGO_ENCODED_RUSTFLAGS="$CARGO_ENCODED_RUSTFLAGS"$'\x1f--cfg\x1ftokio_unstable' ;;
    esac
elif [ -n "${RUSTFLAGS+x}" ]; then
    case "$RUSTFLAGS" in
        *tokio_unstable*) ;;
        *) export RUSTFLAGS="$RUSTFLAGS --cfg tokio_unstable" ;;
    esac
fi
