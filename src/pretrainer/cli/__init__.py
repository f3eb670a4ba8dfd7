"""The command line: argument grammar, what each verb does, the chat REPL."""
