from distflow.cli import exit_process, main

exit_process(main())
