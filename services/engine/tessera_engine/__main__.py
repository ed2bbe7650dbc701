from tessera_engine.server import main

main()
