"""`hsx` subcommands: one module per command, each exposing `register(subparsers)`.

A module's `register` adds its subparser and sets `func=` to a callable taking the parsed
namespace and returning an exit code. cli.py discovers the modules, so adding a command never
touches a shared file.
"""
