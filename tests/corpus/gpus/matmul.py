import time, torch
a = torch.randn(8192, 8192, device="cuda"); b = torch.randn(8192, 8192, device="cuda")
end = time.time() + float(__import__("sys").argv[1])
while time.time() < end:
    c = a @ b
    torch.cuda.synchronize()
