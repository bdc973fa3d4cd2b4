"""What every request goes through before and around its handler: who may call (`guards`), how
much is admitted (`admission`), the request's span (`tracing_mw`), and the error tree every
refusal is rendered from (`errors`)."""
