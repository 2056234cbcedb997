from distflow.cli import console_main

console_main()
