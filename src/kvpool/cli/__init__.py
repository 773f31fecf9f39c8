"""The command line: `kvpool bench | plan | generate | chat | serve` (`main`), the built-in
benchmark (`bench`) and its HTTP counterpart (`http_bench`), the terminal chat, `serve`'s
options, and the flags shared by several commands (`tier_flags`, `parallel_flag`).

May import: every other part of kvpool; nothing imports the CLI."""
