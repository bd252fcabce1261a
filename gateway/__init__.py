"""The gateway: the front door of a hybridserve deployment.

It answers the OpenAI HTTP API and proxies the gRPC Generation API, and sends each request to one of
several workers, chosen by prefix affinity (the worker that already holds the prompt's leading
blocks) weighed against load. It holds no model and no cache, only routing state; it is its own
service so that it scales, restarts and is deployed apart from the workers it fronts."""
