"""`ephost plugin-info` and `ephost build`: inspect a plugin library, build the built-in plugins."""

from __future__ import annotations

from host.cli.app import CliError


def cmd_plugin_info(args) -> int:
    try:
        from host.plugins import plugin_info as pinfo
    except ModuleNotFoundError as exc:
        if exc.name != "host.plugins.plugin_info":
            raise
        raise CliError("plugin-info needs host.plugins.plugin_info, which this installation lacks") from exc
    import abi

    version = abi.ABI_VERSION if args.api_version is None else args.api_version
    print(pinfo.format_plugin_info(pinfo.plugin_info(args.path, version)))
    return 0


def cmd_build(args) -> int:
    from host.native_build import build_everything

    for name, path in build_everything().items():
        print(f"{name}: {path}")
    return 0
