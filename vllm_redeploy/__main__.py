from vllm_redeploy.cli import main

main()
