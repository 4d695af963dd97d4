from ddptrain.cli import main
from ddptrain.errors import end_process

end_process(main())
