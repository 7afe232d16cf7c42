def main():
    print("mopd")
