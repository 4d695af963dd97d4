from ddptrain.cli import main
from ddptrain.errors import end_process

# Guarded: a process that imports the main module again (multiprocessing's spawn and fork
# server do, as __mp_main__) must not run the CLI.
if __name__ == "__main__":
    end_process(main())
